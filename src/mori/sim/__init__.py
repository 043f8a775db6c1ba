"""The discrete-event simulator: engine replicas, closed-loop replay, metrics."""
