"""gptopt serve: the OpenAI protocol (protocol.py), the app and its routes (app.py, guard.py, routes.py, sse.py),
the runner (server.py), the continuous-batching engine behind client.EngineClient (engine.py, events.py,
engine_process.py: the parent's side of an engine in a process of its own, engine_entry.py and engine_child.py:
the child's), start-up (startup.py: the process's switches, build_engine), Prometheus metrics.
"""
