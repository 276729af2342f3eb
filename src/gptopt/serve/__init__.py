"""Serving: the OpenAI protocol (protocol.py), the routes (app.py), the runner (server.py), the
continuous-batching engine behind engine.EngineClient (engine.py, engine_process.py), Prometheus metrics.

    gptopt serve --model out/ --port 8000

Needs the 'serve' extra (fastapi, uvicorn, prometheus-client); importing this package alone does not.
"""
