"""Pipeline stages, installed as ``flowgrpo_cli.stages``: one module per stage, each exposing
``run(config, ...) -> manifest``. A stage never imports another stage."""
