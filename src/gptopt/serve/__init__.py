"""gptopt serve: the OpenAI protocol (protocol.py), the app and its routes (app.py, guard.py, routes.py, sse.py),
the runner (server.py), the continuous-batching engine behind client.EngineClient (engine.py, events.py,
engine_process.py), Prometheus metrics.
"""
