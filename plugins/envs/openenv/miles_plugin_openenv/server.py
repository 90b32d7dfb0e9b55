"""Serve the bundled ``sum_guess`` game with OpenEnv's own ``create_app`` under uvicorn.

``python -m miles_plugin_openenv.server --port 8000`` (the recipe's server; tests start it in a
subprocess). Any other OpenEnv environment server works the same way with the ``openenv`` env.
"""
from __future__ import annotations

import argparse


def build_app(max_concurrent_envs: int = 256, teacher_carry_accuracy: float | None = None):
    from openenv.core.env_server.http_server import create_app

    from .game import TEACHER_CARRY_ACCURACY, GuessAction, GuessObservation, SumGuessEnvironment

    acc = TEACHER_CARRY_ACCURACY if teacher_carry_accuracy is None else teacher_carry_accuracy
    # create_app builds one instance per WebSocket session from a class: the setting rides on a subclass
    game = type("SumGuessEnvironment", (SumGuessEnvironment,), {"TEACHER_CARRY_ACCURACY": acc})
    return create_app(game, GuessAction, GuessObservation, env_name="sum_guess",
                      max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-sessions", type=int, default=256, help="concurrent WebSocket sessions")
    ap.add_argument("--teacher-carry-accuracy", type=float, default=None,
                    help="how often the reference answer keeps a carry (default 0.4)")
    args = ap.parse_args(argv)
    uvicorn.run(build_app(args.max_sessions, args.teacher_carry_accuracy), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
