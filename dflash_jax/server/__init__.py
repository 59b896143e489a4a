"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

    from dflash_jax.server.config import ServeConfig
    from dflash_jax.server.launch import serve
    serve(config, runner, tokenizer, model_name=None, controller=None, warmup=None)  # blocks; returns 0

or `app = dflash_jax.server.app.create_app(...)` and `dflash_jax.server.launch.run_server(app, config)`.
Modules are imported explicitly (this package imports nothing, so reading `ServeConfig` stays cheap).
"""
