"""The engine process around the core:

- `proc`: EngineCoreProc — sockets, lifecycle, signals, drain, the busy loop and its inputs;
- `io_thread`: the thread that owns the ROUTER socket (per-client pacing and bounds, backlogs,
  heartbeats, health answers);
- `handoff`: the typed items between the two, and the bounded per-client inboxes;
- `bookkeeping`: the records of requests and clients, and the output bytes each client holds;
- `delivery`: from the core's outputs to the clients' messages, through the decode stage;
- `heartbeat` (the busy loop's stamps), `watchdog` (a hung step ends the engine), `health`
  (the `engine health` probe);
- `options` (ProcConfig and the flags made from configuration fields), `transport` (addresses,
  ipc sockets, CURVE, the waker), `frames` (peeking into an oversized frame), `metrics`
  (Prometheus), `launcher` (starting and stopping an engine process).
"""
