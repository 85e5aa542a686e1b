"""The builder Ray's own tools call (`serve run mtpserve.cli.ray_app:build_app model=M.gguf replicas=2`, or a
`serve deploy` config: docs/cluster.md): `mtpserve serve`'s flags parsed by the CLI's own parser, then the
application of mtpserve.cluster. It lives with the CLI so that the flags have one definition and the cluster
never imports the CLI."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..cluster.app import application
from .serve import cluster_options, parsed_serve_args, settings_from_args


def build_app(args: Mapping[str, Any]) -> Any:
    """`args` are `mtpserve serve`'s long flags without dashes (`model`, `parallel`, `replicas`, `router`,
    `api-key`, ...), values as strings; a flag without a value takes `true`."""
    argv: list[str] = []
    for name, value in args.items():
        flag = "--" + str(name).replace("_", "-")
        argv += [flag] if value is True or str(value).lower() == "true" else [flag, str(value)]
    parsed = parsed_serve_args(argv)
    return application(settings_from_args(parsed), cluster_options(parsed))
