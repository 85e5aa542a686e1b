"""The HTTP server: llama-server's endpoints and command line, the OpenAI API, on FastAPI + uvicorn.

Imports go one way: `cli` -> `server` -> `engine`. `state.py` holds the settings and the loaded model,
`app.py` the routes, `params.py` and `chat.py` turn request bodies into engine requests and generated
text into responses, `metrics.py` and `logs.py` report.
"""
