"""dsa-generate --compare end to end on the small random V3.2: every configuration runs
in its own interpreter, the table / JSON / plot come out, an fp32 model's paged fp32
cache gives the unpatched model's tokens, and the cache bytes are the layouts' bytes."""
import json

import pytest

from dsa import cache_token_bytes
from dsa.generate import main
from dsa.train.model import v32_config


def test_compare_fp32_small(tmp_path, capsys):
    out_json, out_png = tmp_path / "g.json", tmp_path / "g.png"
    prompt, new = 40, 4
    rc = main(["--compare", "--layers", "2", "--dtype", "fp32", "--prompt-lengths", str(prompt),
               "--new-tokens", str(new), "--json", str(out_json), "--plot", str(out_png),
               "--no-progress", "--timeout", "300"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "decode ms/tok" in printed and out_png.stat().st_size > 0
    rows = {r["config"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"unpatched", "dsa-fp32", "dsa-bf16", "dsa-fp8"}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["unpatched"]["cache_type"] != "NoneType"
    assert rows["dsa-fp32"]["agreement"] == 1.0
    for name in ("dsa-fp32", "dsa-bf16", "dsa-fp8"):
        r = rows[name]
        assert r["cache_type"] == "DsaCache" and r["fallbacks"] == {}
        assert len(r["tokens"]) == 1 and len(r["tokens"][0]) == new
        assert r["decode_ms_per_token"] > 0 and r["prefill_tokens_per_s"] > 0
    # Bytes per cached token: whole 64-token blocks of latent (576 values, 64 rope) and
    # indexer-key (index_head_dim values) records, per layer.
    cfg = v32_config(2, prompt + new, None)
    rope = cfg.qk_rope_head_dim
    cached = prompt + new - 1
    blocks = -(-cached // 64)
    for name, dtype in (("dsa-fp32", "fp32"), ("dsa-bf16", "bf16"), ("dsa-fp8", "fp8")):
        per_token = (cache_token_bytes(cfg.kv_lora_rank + rope, rope, dtype)
                     + cache_token_bytes(cfg.index_head_dim, 0, dtype))
        want = cfg.num_hidden_layers * blocks * 64 * per_token / cached
        assert rows[name]["cache_bytes_per_token"] == pytest.approx(want), name
    assert rows["dsa-fp8"]["cache_bytes_per_token"] < rows["dsa-bf16"]["cache_bytes_per_token"] \
        < rows["dsa-fp32"]["cache_bytes_per_token"]


def test_bad_arguments():
    with pytest.raises(SystemExit):
        main(["--new-tokens", "1"])
    with pytest.raises(SystemExit):
        main(["--prompt-lengths", "abc"])
    with pytest.raises(SystemExit):
        main(["--dtype", "float16"])


def test_unwritable_output_fails_before_any_run(tmp_path, capsys):
    """--json under a path that cannot exist (root passes os.access there) is exit 2 at
    once, naming the flag; torch's dtype names are accepted."""
    import time
    start = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        main(["--json", "/proc/nope/x.json", "--no-progress", "--dtype", "bfloat16"])
    assert e.value.code == 2 and time.perf_counter() - start < 5
    assert "--json: cannot write '/proc/nope/x.json'" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        main(["--compare", "--plot", str(tmp_path / "file" / "p.png"), "--json", str(tmp_path / "g.json")])
    assert "--plot: cannot write" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()  # the probe leaves nothing behind


def test_auto_dtype_follows_the_measured_bf16_rate():
    """--dtype auto (the default) picks bf16 only where torch's bf16 matmul runs at least
    half the fp32 rate on this CPU; an explicit dtype is taken as given; `auto` is in the
    error of a bad --dtype."""
    from dsa.bench.machine import BF16_NATIVE_MIN_RATIO, probe_bf16
    from dsa.generate import resolve_dtype
    probe = probe_bf16(budget_s=0.5)
    dtype, why = resolve_dtype("auto", probe)
    native = probe["bf16_flops"] >= BF16_NATIVE_MIN_RATIO * probe["fp32_flops"]
    assert dtype == ("bf16" if native else "fp32"), why
    assert ("native" if native else "emulated") in why
    assert resolve_dtype("auto")[0] in ("bf16", "fp32")  # measures for itself
    assert resolve_dtype("bf16") == ("bf16", "--dtype") and resolve_dtype("fp32") == ("fp32", "--dtype")


def test_bad_dtype_names_auto(capsys):
    with pytest.raises(SystemExit):
        main(["--dtype", "half"])
    assert "expected auto, fp32 / float32 or bf16 / bfloat16, got 'half'" in capsys.readouterr().err
