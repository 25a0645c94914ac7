"""The engine process around the core:

- `proc`: EngineCoreProc — sockets, lifecycle, signals, drain, the busy loop and its inputs;
- `io_thread`: the thread that owns the ROUTER socket (per-client pacing and bounds, backlogs,
  heartbeats, health answers);
- `handoff`: the typed items between the two, and the bounded per-client inboxes;
- `bookkeeping`: the records of requests and clients, and the output bytes each client holds;
- `delivery`: from the core's outputs to the clients' messages, through the decode stage;
- `heartbeat` (the busy loop's stamps, which health answers read), `watchdog` (a hung step
  ends the engine);
- `options` (ProcConfig, its flags and the files its secrets come from), `transport`
  (addresses, ipc sockets, CURVE, the waker), `frames` (peeking into an oversized frame),
  `metrics` (Prometheus).

The `python -m engine health` probe is a client (`frontend/health.py`), and so is the
launcher that starts and stops engine processes (`frontend/launcher.py`).
"""
