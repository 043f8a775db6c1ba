"""The discrete-event simulator: engine replicas, closed-loop replay, metrics."""

MODEL_VERSION = 8
"""Bumped whenever a change to the simulator or a policy changes results for the same
settings, so stored sweep results from an older model are not reused.

2: ``thunderagent`` follows ThunderAgent's own scheduler (token capacity with buffers,
pauses and resumes on a 5 s check, a pause leaves the KV to the engine's LRU).
3: ``mori`` spreads admitted cacheless programs by load across replicas while memory
does not bind (``mori-pack`` keeps the paper's packing).
4: ``mori`` spreads them onto the replica with the most room whenever that places the
round's whole batch, and packs by Best-Fit-Decreasing only when it does not (it had
packed above 70% full, overfilling the fullest replica).
5: the ``cpu-tiny-llama`` preset is calibrated again (2026-12-04, the engine on one CPU
of its own as the real-engine benchmark runs it): its prefills are up to 5x faster.
6: a preset may charge a fixed overhead per request (``request_overhead_s``); the
``cpu-tiny-llama`` preset is calibrated again (2026-12-05) with one fitted (7.5 ms: HTTP,
tokenization and the output path share the engine's CPU) and a host-tier copy rate
fitted to timed reloads (163 MB/s, not a nominal 10 GB/s); a policy not told a recompute
rate prices one at a context the model holds (the tiny CPU model's 4,064 tokens, not
32k).
7: the write-through host tier copies only GPU pages whose KV is computed: while pages are
reserved for KV not computed yet (a running request's prompt tail and output), the CPU
pool may hold that much more (``KVPools.cpu_room``), and it evicts when they are written;
a request that ends keeps only its whole pages (engines cache whole blocks).
8: on a preset whose host-tier copy runs on the engine's own processor
(``reload_on_engine``: ``cpu-tiny-llama``) a reload takes engine time in the iteration
that starts the request, not a link's beside the compute, and ``mori`` prices a park by
it (``SimConfig.learn_costs``, as ``mori serve --learn-costs`` learns it)."""
