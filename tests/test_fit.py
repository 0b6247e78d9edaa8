"""`ramjet fit` reproduces the published GLM-5.3 KV-capacity figures to their printed precision.

Fixtures: tests/fixtures/glm53/config.json has GLM-5.3's layer and indexer settings;
nvfp4.index.json and model.safetensors.index.json (the FP8 release) carry total_size
values inside the range that reproduces every published figure (464.12 GB and 755.62 GB).
The published setting: 56 B200s at 180 GB, utilisation 0.92, 12 GB overhead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ramjet.ops import fit
from ramjet.cli import main

FIX = Path(__file__).resolve().parent / "fixtures" / "glm53"
CONFIG, NVFP4, FP8 = FIX / "config.json", FIX / "nvfp4.index.json", FIX / "model.safetensors.index.json"
B200 = fit.Budget(hbm_gb=180, util=0.92, overhead_gb=12)


def report(index: Path = NVFP4, **kw) -> fit.Report:
    kw = {"budget": B200, "gpus": 56, **kw}
    return fit.fit(fit.read_json(CONFIG), fit.read_json(index), fit.read_json(FP8), **kw)


def row(r: fit.Report, layout: str, tp: int) -> fit.Row:
    return next(x for x in r.rows if x.layout == layout and x.tp == tp)


@pytest.mark.unit
def test_bytes_per_token():
    model = fit.Model.from_config(fit.read_json(CONFIG))
    assert (model.layers, model.indexer_layers, model.listed_indexer_layers) == (78, 21, 21)
    assert model.indexer_row_bytes == 132
    assert model.bytes_per_token() == 47_700
    assert model.bytes_per_token(mtp_layers=1) == 576 * 79 + 132 * 22
    assert model.bytes_per_token(mla_bytes=656) == 656 * 78 + 132 * 21


@pytest.mark.unit
def test_tp4_vs_tp8_nvfp4():
    r = report(layouts=("tp",))
    tp4, tp8 = row(r, "tp", 4), row(r, "tp", 8)
    assert f"{tp4.weights_per_gpu_gb:.2f} {tp4.kv_per_gpu_gb:.2f}" == "116.03 37.57"
    assert f"{tp8.weights_per_gpu_gb:.2f} {tp8.kv_per_gpu_gb:.2f}" == "58.01 95.59"
    assert (tp4.tokens_per_replica, tp8.tokens_per_replica) == (787_653, 2_003_889)
    assert (f"{tp4.sessions:.2f}", f"{tp8.sessions:.2f}") == ("3.00", "7.64")
    assert (tp4.replicas, tp8.replicas) == (14, 7)
    assert (f"{tp4.fleet_tokens / 1e6:.2f}", f"{tp8.fleet_tokens / 1e6:.2f}") == ("11.03", "14.03")
    assert (tp4.max_context_fits, tp8.max_context_fits) == (False, True)


@pytest.mark.unit
def test_session_and_max_context_sizes():
    d = report().as_dict()
    assert f"{d['session_gb']:.2f}" == "12.50"
    assert f"{d['max_context_gb']:.2f}" == "50.02"  # one 1,048,576-token request
    assert f"{d['budget_per_gpu_gb']:.1f}" == "153.6"


@pytest.mark.unit
def test_dcp():
    r = report(layouts=("dcp",), dcp=8)
    assert row(r, "dcp", 4).refused == "dcp 8 does not divide TP 4: refused"
    tp8 = row(r, "dcp", 8)
    assert tp8.tokens_per_replica == 16_031_116
    assert f"{tp8.sessions:.2f} {tp8.fleet_tokens / 1e6:.2f}" == "61.15 112.22"
    r = report(layouts=("dcp",), dcp=4)
    assert f"{row(r, 'dcp', 4).sessions:.2f} {row(r, 'dcp', 8).sessions:.2f}" == "12.02 30.58"
    r = report(layouts=("dcp",))  # default: split over every GPU of the replica
    assert row(r, "dcp", 8).dcp == 8 and row(r, "dcp", 4).dcp == 4


@pytest.mark.unit
def test_fp8_checkpoint():
    r = report(FP8, layouts=("tp",))
    tp4, tp8 = row(r, "tp", 4), row(r, "tp", 8)
    assert tp4.refused.startswith("weights alone exceed the budget (188.90 > 153.60 GB)")
    assert f"{tp8.weights_per_gpu_gb:.2f} {tp8.kv_per_gpu_gb:.2f}" == "94.45 59.15"
    assert tp8.tokens_per_replica == 1_239_997
    assert f"{tp8.sessions:.2f} {tp8.fleet_tokens / 1e6:.2f}" == "4.73 8.68"


@pytest.mark.unit
def test_checkpoint_size_difference():
    r = report()
    assert f"{r.weights / 1e9:.2f} {r.other_weights / 1e9:.2f}" == "464.12 755.62"
    assert f"{r.smaller_pct:.1f}" == "38.6"


@pytest.mark.unit
def test_flashmla_row_bytes():
    r = report(layouts=("tp",), mla_bytes=656)
    assert f"{row(r, 'tp', 4).sessions:.2f} {row(r, 'tp', 8).sessions:.2f}" == "2.66 6.76"


@pytest.mark.unit
def test_dp_attention_gives_every_rank_a_private_pool():
    r = report(layouts=("tp", "dp-attention"))
    tp8, dp8 = row(r, "tp", 8), row(r, "dp-attention", 8)
    assert dp8.pools == 8 and dp8.tokens_per_pool == tp8.tokens_per_pool
    assert dp8.tokens_per_replica == 8 * tp8.tokens_per_replica
    assert dp8.max_context_fits  # 95.59 GB per rank holds one 50.02 GB request


@pytest.mark.unit
def test_glm53_fp8_on_h200_dp_attention():
    """The bundle's engine: 141 GB x 0.85, MTP on, SGLang's FP8 cache in FlashMLA's layout (656 B a layer).
    The article measured ~193,000 tokens per rank, 1.55M per server."""
    cfg, idx = fit.read_json(CONFIG), fit.read_json(FP8)

    def dp8(overhead_gb: float = fit.DEFAULT_OVERHEAD_GB, mla: int = fit.FLASHMLA_FP8_ROW_BYTES) -> fit.Row:
        return fit.fit(cfg, idx, budget=fit.Budget(141, 0.85, overhead_gb), tps=(8,), layouts=("dp-attention",),
                       mtp_layers=1, mla_bytes=mla).rows[0]

    assert fit.Model.from_config(cfg).bytes_per_token(656, mtp_layers=1) == 656 * 79 + 132 * 22 == 54_728
    assert dp8().tokens_per_pool == 244_808  # an upper estimate: 12 GB overhead is an assumption
    fitted = dp8(fit.H200_FITTED_OVERHEAD_GB)  # the overhead that reproduces the measurement
    assert fitted.tokens_per_pool == 193_646 and f"{fitted.tokens_per_replica / 1e6:.2f}" == "1.55"
    # the 576-byte rows of vLLM's FlashInfer layout overstated this engine's pool by 13%
    assert dp8(mla=576).tokens_per_pool == 276_769


@pytest.mark.unit
def test_sglang_row_bytes_follow_the_cache_dtype():
    assert fit.sglang_row_bytes("fp8_e4m3") == fit.FLASHMLA_FP8_ROW_BYTES == 512 + 4 * 4 + 64 * 2
    assert fit.sglang_row_bytes("bfloat16") == fit.sglang_row_bytes("auto") == 576 * 2


@pytest.mark.unit
def test_cli_the_bundle_readme_command(capsys):
    """deploy/glm53_h200/README.md, "Cache capacity per rank": the command and the two figures it quotes."""
    args = ["fit", str(CONFIG), str(FP8), "--util", "0.85", "--mtp-layers", "1", "--layout", "dp-attention",
            "--tp", "8", "--mla-bytes", "656", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_token"] == 54_728 and data["rows"][0]["tokens_per_pool"] == 244_808
    assert main([*args, "--overhead-gb", "14.8"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert (row["tokens_per_pool"], row["tokens_per_replica"]) == (193_646, 1_549_168)


@pytest.mark.unit
def test_indexer_layer_rules():
    assert fit.count_indexer_layers({"index_topk_freq": 4, "index_skip_topk_offset": 3}, 78) == 21
    assert fit.count_indexer_layers({}, 61) == 61  # DeepSeek-V3.2: an indexer on every layer
    assert fit.count_indexer_layers({"index_topk_pattern": "FFSS" * 3}, 12) == 6
    plain = fit.Model.from_config({"num_hidden_layers": 61, "max_position_embeddings": 163840})
    assert plain.bytes_per_token() == 576 * 61  # no indexer keys: plain MLA


@pytest.mark.e2e
def test_cli_subprocess_prints_the_published_table():
    p = subprocess.run([sys.executable, "-m", "ramjet", "fit", str(CONFIG), str(NVFP4), str(FP8), "--hbm-gb", "180",
                        "--gpus", "56", "--layout", "tp"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for text in ("464.12 GB", "21 of 78 layers", "47,700 B = 576 B latent x 78 layers + 132 B indexer x 21 layers",
                 "262,144 tokens = 12.50 GB", "1,048,576 tokens = 50.02 GB", "755.62 GB", "38.6% smaller"):
        assert text in out
    lines = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.startswith("tp ")}
    assert lines[("tp", "4")][5:12] == ["37.57", "787,653", "787,653", "3.00", "14", "11.03M", "no"]
    assert lines[("tp", "8")][5:12] == ["95.59", "2,003,889", "2,003,889", "7.64", "7", "14.03M", "starts"]


@pytest.mark.unit
def test_cli_json(capsys):
    rc = main(["fit", str(CONFIG), str(FP8), "--hbm-gb", "180", "--gpus", "56", "--layout", "dcp", "--tp", "8",
               "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_token"] == 47_700 and data["other_weights_gb"] is None
    assert [(r["layout"], r["tp"], r["dcp"]) for r in data["rows"]] == [("dcp", 8, 8)]


@pytest.mark.unit
@pytest.mark.parametrize("args,message", [
    (["missing.json", str(NVFP4)], "cannot read missing.json"),
    ([str(NVFP4), str(NVFP4)], "missing or bad 'num_hidden_layers'"),
    ([str(CONFIG), str(CONFIG)], "no metadata.total_size"),
    ([str(CONFIG), str(NVFP4), "--dcp", "0"], "must be >= 1"),
])
def test_cli_errors_exit_2_with_a_message(capsys, args, message):
    assert main(["fit", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.unit
def test_cli_rejects_invalid_json(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["fit", str(bad), str(NVFP4)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
