"""The ``miserver`` command: ``serve``, ``check``, ``docs``, ``import-default``.

Every ``serve`` flag is the lower-case, dashed form of a configuration variable (contract section
1): ``--port 9000`` is ``PORT=9000``; flags win over the environment. An invalid value exits with
status 2 and one line naming the variable.
"""

from __future__ import annotations

import argparse
import os
import sys

from miserver.spec import settings as settings_def
from miserver.spec import settings_reference
from miserver.spec.settings import ConfigError, load_settings

EXTRA_VARIABLES = ("WEIGHTS_TOKENS", "WEIGHTS_TOKENS_FILE")


def _flag(variable: str) -> str:
    return "--" + variable.lower().replace("_", "-")


def _help(variable: str, default: str, fmt: str, effect: str) -> str:
    first = effect.split(". ")[0].rstrip(".")
    text = f"{first}. Format: {fmt}. Default: {default}. Overrides ${variable}."
    return text.replace("`", "").replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    # the docstring's first line without its reST markup: --help is plain text (issue 32, item 6)
    parser = argparse.ArgumentParser(
        prog="miserver", description=__doc__.splitlines()[0].replace("``", "")
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the server",
        description="Run the server. Every flag is also an environment variable (flags win); "
        "WEIGHTS_TOKENS (label:role:secret entries, comma-separated) is environment-only. The "
        "whole reference: docs/settings.md.",
    )
    rows = {row[0]: row for row in settings_reference.rows()}
    for variable, _field, _kind in settings_def.VARIABLES:
        _, _, default, fmt, effect = rows[variable]
        serve.add_argument(
            _flag(variable),
            dest=variable,
            metavar=variable,
            default=None,
            help=_help(variable, default, fmt, effect),
        )
    _, _, default, fmt, effect = rows["WEIGHTS_TOKENS_FILE"]
    serve.add_argument(
        _flag("WEIGHTS_TOKENS_FILE"),
        dest="WEIGHTS_TOKENS_FILE",
        default=None,
        metavar="PATH",
        help=_help("WEIGHTS_TOKENS_FILE", default, fmt, effect),
    )
    check = sub.add_parser("check", help="exhaustively model-check the weights lifecycle table")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.add_parser(
        "docs",
        help="regenerate the generated docs (the state machine, the settings and API "
        "references, the JSON schema)",
    )
    imp = sub.add_parser("import-default", help="import the embedded default model now")
    imp.add_argument(_flag("MISERVER_HOME"), dest="MISERVER_HOME", default=None)
    return parser


def serves_on_cpu(settings: settings_def.Settings) -> bool:
    """Whether ``settings`` serve on the CPU, decided before torch loads: ``DEVICE=cpu``, or
    ``auto`` on a machine without an NVIDIA device node (``/dev/nvidia0``...)."""
    if settings.device != "auto":
        return settings.device == "cpu"
    import glob

    return not glob.glob("/dev/nvidia[0-9]*")


def set_thread_environment(settings: settings_def.Settings) -> None:
    """OpenMP's environment for ``miserver serve``, set before torch loads; an explicit
    environment wins.

    - A CPU server (:func:`serves_on_cpu`): ``OMP_NUM_THREADS=1``, so torch's work outside the
      engine thread (loading, the event loop) runs on one core, and OpenMP's default wait
      policy. The engine thread sets its own counts (``CPU_THREADS``; ``CPU_MATMUL_THREADS``
      for the linear products, whose extra threads spin briefly between products). A team made
      by the main thread would count against the cores, and OpenMP would then put the product
      team's threads to sleep between products (44 against 32 ms a token on 2 cores;
      docs/decisions.md, "Products on every core").
    - A CUDA server: ``OMP_WAIT_POLICY=PASSIVE`` as before (idle OpenMP threads sleep instead
      of spinning on shared cores; its CPU work is small).
    """
    if serves_on_cpu(settings):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "import-default"):
        overrides = {k: v for k, v in vars(args).items() if k.isupper() and v is not None}
        try:
            settings = load_settings(overrides=overrides)
        except ConfigError as exc:
            print(f"miserver: invalid configuration: {exc}", file=sys.stderr)
            return 2
        if args.command == "serve":
            set_thread_environment(settings)
            from miserver.server import serve

            return serve(settings)
        from miserver.serving.models.default_model import import_default

        import_default(settings.home, progress=True)
        return 0
    if args.command == "check":
        from miserver.fsm.check import main as check_main

        return check_main(json_output=args.json)
    if args.command == "docs":
        from miserver.docs_gen import main as docs_main

        return docs_main()
    raise AssertionError(args.command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
