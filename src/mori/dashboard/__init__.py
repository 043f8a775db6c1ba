"""The dashboard: the idleness spectrum, tiers, the held requests and the scheduler's
decisions, live in ``mori serve`` (``/dashboard``) and over a simulated run
(``mori simulate --timeline``).

``snapshot`` reads a policy at one instant, ``history`` keeps the time series, ``svg``
draws the charts on the server, ``payload`` turns both into the JSON the page renders,
``page`` assembles the self-contained HTML (assets inline, nothing fetched from the
internet) and ``timeline`` records a simulated run.
"""
