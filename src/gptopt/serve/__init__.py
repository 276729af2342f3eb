"""Serving: the FastAPI app (app.py), the continuous-batching engine (engine.py), Prometheus metrics.

    gptopt serve --model out/ --port 8000

Needs the 'serve' extra (fastapi, uvicorn, prometheus-client); importing this package alone does not.
"""
