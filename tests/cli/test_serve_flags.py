"""`mtpserve serve`'s llama-server command line: `--flag_name` read as `--flag-name`, several --host addresses,
CORS, tags and the flags refused because what they switch on is not built."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from mtpserve.cli import build_parser, llama_flag_names
from mtpserve.cli.serve import listening_sockets, settings_from_args
from mtpserve.engine.config import GrammarLimits
from mtpserve.engine.devices import GpuRequest


def parse(*flags: str):
    return build_parser().parse_args(llama_flag_names(["serve", "-m", "model.gguf", *flags]))


def test_underscores_in_flag_names_read_as_dashes_and_values_are_left_alone():
    args = parse("--backend_sampling", "--cors_origins=localhost", "--alias", "my_model")
    assert args.backend_sampling and args.cors_origins == "localhost" and args.alias == "my_model"
    assert llama_flag_names(["generate", "--n_predict"]) == ["generate", "--n_predict"]  # serve only


def test_cors_and_tags_reach_the_settings(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    args = build_parser().parse_args(
        ["serve", "-m", str(model), "--cors-origins", "localhost", "--no-cors-credentials", "--tags", "chat, fim"]
    )
    settings = settings_from_args(args)
    assert settings.cors.origins == "localhost" and not settings.cors.credentials
    assert settings.tags == ["chat", "fim"]


def test_cors_defaults_to_any_origin_with_a_key_and_localhost_without(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    open_server = settings_from_args(build_parser().parse_args(["serve", "-m", str(model)]))
    keyed = settings_from_args(build_parser().parse_args(["serve", "-m", str(model), "--api-key", "k"]))
    assert open_server.cors.origins == "localhost" and keyed.cors.origins == "*"


def test_grammar_limits_reach_the_engine(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    flags = ["--grammar-max-size", "4096", "--grammar-timeout", "2.5", "--grammar-max-memory", "300"]
    engine = settings_from_args(
        build_parser().parse_args(["serve", "-m", str(model), *flags, "--grammar-workers", "3"])
    ).engine
    assert engine.grammar == GrammarLimits(max_bytes=4096, timeout_s=2.5, max_memory=300 << 20, workers=3)
    with pytest.raises(ValueError, match="grammar-workers"):
        settings_from_args(build_parser().parse_args(["serve", "-m", str(model), "--grammar-workers", "0"]))


def test_checkpoint_flags_reach_the_engine(tmp_path):
    """llama-server's -ctxcp/--ctx-checkpoints/--swa-checkpoints and -cms/--checkpoint-min-step."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    for flags in (["-ctxcp", "8", "-cms", "4096"], ["--swa-checkpoints", "8", "--checkpoint-min-step", "4096"]):
        engine = settings_from_args(build_parser().parse_args(["serve", "-m", str(model), *flags])).engine
        assert (engine.ctx_checkpoints, engine.checkpoint_min_step) == (8, 4096)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "-m", str(model), "-cms", "-1"])


def test_the_logical_batch_bounds_the_ubatch_and_reaches_infill(tmp_path):
    """-b cuts /infill's prefix and suffix (server/infill.py) and, as in llama.cpp, caps -ub."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    default = settings_from_args(build_parser().parse_args(["serve", "-m", str(model)]))
    assert (default.batch_size, default.engine.ubatch, default.spm_infill) == (2048, 512, False)
    small = settings_from_args(build_parser().parse_args(["serve", "-m", str(model), "-b", "64", "--spm-infill"]))
    assert (small.batch_size, small.engine.ubatch, small.spm_infill) == (64, 64, True)
    whole = settings_from_args(build_parser().parse_args(["serve", "-m", str(model), "-ub", "0"]))
    assert whole.engine.ubatch == 2048  # llama.cpp's -ub 0: the logical batch
    with pytest.raises(SystemExit):  # a batch of no tokens would never read a prompt
        build_parser().parse_args(["serve", "-m", str(model), "-b", "0"])


def test_sampler_order_flags_set_every_requests_default_chain(tmp_path):
    """llama-server's --samplers (';'-separated names) and --sampler-seq (chars); its default order is the default."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")

    def samplers(*flags: str):
        return settings_from_args(build_parser().parse_args(["serve", "-m", str(model), *flags])).sampling.samplers

    assert samplers() is None and samplers("--sampler-seq", "edskypmxt") is None
    assert (
        samplers("--samplers", "top_k;top_p;infill")
        == ("top_k", "top_p", "infill")
        == samplers("--sampling-seq", "kpi")
    )
    with pytest.raises(ValueError, match="unknown sampler names"):
        samplers("--samplers", "top_k;fastest")


@pytest.mark.parametrize("flags,says", [(["--tools", "all"], "--tools"), (["--ui-mcp-proxy"], "--ui-mcp-proxy")])
def test_unbuilt_features_stop_the_start_with_one_line(tmp_path, flags, says):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(ValueError, match=says):
        settings_from_args(build_parser().parse_args(["serve", "-m", str(model), *flags]))


def test_one_socket_per_host_on_the_same_port():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    sockets = listening_sockets(["127.0.0.1", "::1"], port)
    try:
        assert [s.family for s in sockets] == [socket.AF_INET, socket.AF_INET6]
        assert {s.getsockname()[1] for s in sockets} == {port}
    finally:
        for s in sockets:
            s.close()


def test_threads_default_to_the_physical_cores_and_poll_reaches_the_pool():
    import torch

    from mtpserve.cli.common import apply_threads
    from mtpserve.kernels.cpu import physical_cores

    before = torch.get_num_threads()
    try:
        args = parse("--poll", "0", "--cpu-strict", "0")
        assert (args.threads, args.poll, args.cpu_strict) == (0, 0, 0)
        apply_threads(args)
        assert torch.get_num_threads() == physical_cores()
        apply_threads(parse("-t", "1"))
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="0-100"):
            apply_threads(parse("--poll", "101"))
    finally:
        torch.set_num_threads(before)
        apply_threads(parse("-t", str(before)))  # and --poll back to its default


def test_no_repack_stops_the_kernels_keeping_tiles():
    """llama.cpp's -nr / --no-repack: the kept tiles' limit drops to 0; --repack (the default) restores it."""
    import torch

    from mtpserve.cli.common import apply_threads
    from mtpserve.kernels.cpu import KEPT_TILES_LIMIT, tile_limit

    threads = torch.get_num_threads()
    try:
        assert parse().repack and not parse("-nr").repack and not parse("--no-repack").repack
        apply_threads(parse("-t", str(threads), "--no-repack"))
        assert tile_limit(0) == 0
        apply_threads(parse("-t", str(threads), "--repack"))
        assert tile_limit(KEPT_TILES_LIMIT) == KEPT_TILES_LIMIT
    finally:
        apply_threads(parse("-t", str(threads)))


def test_no_mmap_and_mlock_reach_the_engine_and_skip_the_read_ahead(tmp_path):
    """llama-server's --no-mmap and --mlock: the weights read into memory or pinned while loading
    (gguf.residency), so the background read of the file ahead of the first request is left out."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    plain = settings_from_args(build_parser().parse_args(["serve", "-m", str(model)]))
    assert plain.engine.use_mmap and not plain.engine.use_mlock and plain.reads_ahead
    for flag in ("--no-mmap", "--mlock"):
        s = settings_from_args(build_parser().parse_args(["serve", "-m", str(model), flag]))
        assert (s.engine.use_mmap, s.engine.use_mlock) == ((False, False) if flag == "--no-mmap" else (True, True))
        assert not s.reads_ahead
        # where they are not applied (layers on GPUs, tensor-parallel ranks) the file is read ahead as without them
        assert dataclasses.replace(s, gpu=GpuRequest()).reads_ahead
        assert dataclasses.replace(s, tensor_parallel=("cpu", "cpu")).reads_ahead
    assert not settings_from_args(build_parser().parse_args(["serve", "-m", str(model), "--no-warmup"])).reads_ahead
