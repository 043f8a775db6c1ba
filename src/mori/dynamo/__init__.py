"""MORI inside NVIDIA Dynamo: a router service (``mori dynamo-router``) that schedules
Dynamo's workers with MORI's control loop. ``turns`` (a request's program, the request
sent on, what an answer says), ``fleet`` (workers as replica slots, capacities from model
cards, the KV view by tier), ``replica`` (a slot as the control loop's replica) and
``turn_handler`` (one turn through the control loop) import no Dynamo; ``router`` does,
and runs only in Dynamo's environment."""
