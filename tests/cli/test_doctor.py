"""`mtpserve doctor` and the planner's recommendation behind it."""

from __future__ import annotations

from mtpserve.cli import main
from mtpserve.engine import EngineConfig
from mtpserve.engine.planner import recommend

from ..conftest import default_model, tinyqwen_path

GIB = 1 << 30


def test_recommend_keeps_what_fits_and_lowers_what_does_not():
    path = tinyqwen_path("Q4_K_M")
    asked = EngineConfig(ctx_size=262144, cache_type_k="f16", cache_type_v="f16")
    roomy = recommend(path, asked, available_bytes=64 * GIB)
    assert roomy.fits and roomy.changes == () and roomy.config == asked
    tight = recommend(path, asked, available_bytes=int(0.2 * GIB))  # f16 KV needs 0.26 GiB, q8_0 0.14
    assert tight.fits and tight.changes == ("-ctk q8_0 -ctv q8_0",) and tight.config.ctx_size == 262144
    tighter = recommend(path, asked, available_bytes=int(0.05 * GIB))
    assert tighter.fits and tighter.changes[0] == "-ctk q8_0 -ctv q8_0" and tighter.changes[-1].startswith("-c ")
    assert tighter.config.ctx_size < 262144 and tighter.plan.required_bytes <= 0.05 * GIB
    hopeless = recommend(path, asked, available_bytes=1 << 20)
    assert not hopeless.fits


def test_doctor_reports_the_machine_and_the_model(capsys):
    assert main(["doctor", "-m", str(default_model("smollm2"))]) == 0
    out = capsys.readouterr().out
    for what in ("python", "torch", "C compiler", "CPU", "model"):
        assert f"] {what}" in out
    assert "fits with -c 4096" in out and "recommended: mtpserve serve -m" in out
    assert "a prompt cache of up to 8.00 GiB in host memory" in out and "--cache-ram 8192" in out


def test_doctor_counts_the_prompt_cache_it_is_given(capsys):
    path = str(default_model("smollm2"))
    assert main(["doctor", "-m", path, "--cache-ram", "512"]) == 0
    assert "a prompt cache of up to 0.50 GiB in host memory" in capsys.readouterr().out
    assert main(["doctor", "-m", path, "--cache-ram", "0"]) == 0
    assert "no prompt cache (--cache-ram 0)" in capsys.readouterr().out


def test_doctor_says_what_to_change_and_fails_when_nothing_fits(capsys):
    path = str(tinyqwen_path("Q4_K_M"))
    assert main(["doctor", "-m", path, "-c", "262144", "--memory", "0.2"]) == 0
    assert "it fits with -ctk q8_0 -ctv q8_0" in capsys.readouterr().out
    assert main(["doctor", "-m", path, "-c", "262144", "--memory", "0.001"]) == 1
    assert "[problem] model" in capsys.readouterr().out


def test_doctor_plans_layers_over_what_if_gpus(capsys):
    """--gpus: the placement planner's auto fit over hypothetical GPUs, as flags for the server."""
    path = str(tinyqwen_path("Q4_K_M"))
    assert main(["doctor", "-m", path, "--gpus", "2,2"]) == 0
    out = capsys.readouterr().out
    assert "] CUDA0" in out and "] CUDA1" in out
    assert "--gpu-layers all --split-mode layer --tensor-split 5,5" in out  # 8 blocks + MTP + output, halved
    assert main(["doctor", "-m", path, "--gpus", "0.5"]) == 0  # less than llama.cpp's 1 GiB fit margin
    assert "--gpu-layers 0 --split-mode layer" in capsys.readouterr().out


def test_doctor_plans_the_gpus_asked_about_whatever_the_hosts_memory(capsys, monkeypatch):
    """--gpus: the plan for those cards with the flags asked (262144 tokens stays 262144), the same on a host with
    little free memory as on a roomy one; --spec-type draft-mtp adds the MTP block and its KV cache to it."""
    from mtpserve.engine import planner

    path = str(tinyqwen_path("Q4_K_M"))
    args = ["doctor", "-m", path, "-c", "262144", "-ctk", "q8_0", "-ctv", "q8_0", "--gpus", "2,2"]
    outputs = []
    for host_free in (64 * GIB, 1 << 20):
        monkeypatch.setattr(planner, "available_memory", lambda device, free=host_free: free)
        for spec in ([], ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]):
            assert main([*args, *spec]) == 0
            outputs.append([line for line in capsys.readouterr().out.splitlines() if "CUDA" in line or "GPU" in line])
    assert outputs[0] == outputs[2] and outputs[1] == outputs[3]  # the host's memory changes nothing
    assert outputs[0] != outputs[1]  # the MTP block and its cache are planned
    assert main([*args, "--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]) == 0
    out = capsys.readouterr().out
    assert "-c 262144 " in out and "--spec-type draft-mtp --spec-draft-n-max 2 --gpu-layers" in out


def test_doctor_notes_what_can_give_way_and_refuses_only_the_resident_part(capsys):
    path = str(tinyqwen_path("Q4_K_M"))
    assert main(["doctor", "-m", path, "--memory", "0.005"]) == 0  # 4096 tokens: ~4.1 MiB resident
    out = capsys.readouterr().out
    assert "memory-mapped, not counted as resident" in out and "[ note  ] memory" in out
    assert "the weights (0.01 GiB, memory-mapped) stay in memory while the context is short" in out


def test_doctor_counts_the_weights_as_resident_with_no_mmap_or_mlock(capsys):
    """serve's --no-mmap and --mlock keep the whole file in the process's memory: 5.9 MB of weights that did not
    count against 5 MiB now refuse it, and the plan says they are resident."""
    path = str(tinyqwen_path("Q4_K_M"))
    for flag in ("--no-mmap", "--mlock"):
        assert main(["doctor", "-m", path, "--memory", "0.005", flag]) == 1, flag
        out = capsys.readouterr().out
        assert "weights 0.01 GiB (resident)" in out and "memory-mapped" not in out, out
    assert main(["doctor", "-m", path, "--memory", "0.05", "--no-mmap"]) == 0
    assert " --no-mmap " in capsys.readouterr().out  # the recommended command keeps it


def test_doctor_plans_a_row_split_as_each_cards_share(capsys):
    """-sm row -ts 1,1 --gpus: tensor parallelism's plan, each card's share of every layer printed."""
    path = str(tinyqwen_path("Q4_K_M"))
    assert main(["doctor", "-m", path, "-sm", "row", "-ts", "1,1", "--gpus", "2,2", "--spec-type", "draft-mtp"]) == 0
    out = capsys.readouterr().out
    assert out.count("50% of every layer") == 2 and "--split-mode row --tensor-split 1,1" in out
    assert main(["doctor", "-m", path, "-sm", "row", "--gpus", "0.01,0.01"]) == 1  # 10 MiB a card: no
