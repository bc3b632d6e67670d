"""FP8 KV pages (issue 20): what the pages hold, where their scales come from, how a package
records them, and the served system with `--kv-dtype`. The GPU kernels are checked against
the same reference in tests/gpu/test_kv_fp8.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.test_fp8 import _common_prefix, _english_tokens, _fp8_checkpoint, _save, _tiny_model
from tests.tp_harness import run_tp, score_tp

FP8 = torch.float8_e4m3fn
REPO = Path(__file__).resolve().parents[1]


def _as_stored(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The test's own FP8 round trip (saturating, nearest): what a page gives back for x."""
    return (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale


def test_fp8_pages_hold_scaled_values_and_attend_as_read_back():
    """Two sequences over shuffled pages, a prefill and then a decode step: the pages hold
    k / k_scale and v / v_scale in e4m3, and attention equals exact attention over the values
    read back; it stays near attention over the unrounded values."""
    from runtime.attention import ReferenceAttention, SeqSpan
    from runtime.kv_cache import KVCache, KVCacheShape
    from runtime.quant import KVQuant

    torch.manual_seed(0)
    hq, hkv, hd, ps = 4, 2, 16, 4
    shape = KVCacheShape(num_layers=2, num_pages=8, page_size=ps, kv_heads=hkv, head_dim=hd)
    quant = KVQuant(k_scales=(1.0, 2.0), v_scales=(1.0, 0.25))
    fp8 = KVCache(shape, torch.float32, "cpu", quant)
    dense = KVCache(shape, torch.float32, "cpu")
    assert fp8.dtype == FP8 and shape.page_bytes(FP8) * 4 == shape.page_bytes(torch.float32)
    tables = [torch.tensor([5, 1, 6]), torch.tensor([3, 0])]
    lengths = [9, 6]
    cos, sin = torch.ones(sum(lengths), hd), torch.zeros(sum(lengths), hd)  # RoPE as identity
    q = torch.randn(sum(lengths), hq, hd)
    k, v = 3 * torch.randn(sum(lengths), hkv, hd), torch.randn(sum(lengths), hkv, hd)
    layer = 1
    spans = [SeqSpan(n, n, t) for n, t in zip(lengths, tables)]
    got = ReferenceAttention(spans, fp8, hd**-0.5).attend(layer, q, k, v, cos, sin)
    near = ReferenceAttention(spans, dense, hd**-0.5).attend(layer, q, k, v, cos, sin)

    cache, start, want = fp8.layers[layer], 0, []
    for n, table in zip(lengths, tables):
        pos = torch.arange(n)
        stored_k = cache[table[pos // ps], 0, pos % ps]
        stored_v = cache[table[pos // ps], 1, pos % ps]
        kk, vv = k[start : start + n], v[start : start + n]
        assert torch.equal(stored_k.float(), _as_stored(kk, 2.0) / 2.0)
        assert torch.equal(stored_v.float(), _as_stored(vv, 0.25) / 0.25)
        kr = _as_stored(kk, 2.0).repeat_interleave(2, 1).transpose(0, 1)
        vr = _as_stored(vv, 0.25).repeat_interleave(2, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1), kr, vr, is_causal=True, scale=hd**-0.5
        )
        want.append(o.transpose(0, 1))
        start += n
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    # e4m3 keeps 3 mantissa bits: a value is off by at most 1/16 of itself
    assert (got - near).abs().max() < 0.15 * near.abs().max()
    assert not torch.equal(got, near)


def _kv_scheme_checkpoint(root: Path, tokenizer_dir: Path, k_scales, v_scales) -> Path:
    """An FP8 (compressed-tensors, per channel) checkpoint calibrated for an FP8 KV cache:
    kv_cache_scheme in its config and self_attn.k_scale / v_scale per layer."""
    from safetensors.torch import load_file

    ckpt, _ = _fp8_checkpoint("ct-channel", root / "weights", tokenizer_dir)
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    for i, (ks, vs) in enumerate(zip(k_scales, v_scales)):
        if ks is not None:
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs)
    qconfig = config.pop("quantization_config")
    qconfig["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    model, tok = _tiny_model(tokenizer_dir)
    return _save(model, tok, root / "kv", tensors, qconfig)


def test_checkpoint_kv_scales_are_recorded_and_used(tokenizer_dir, tmp_path):
    from prepare.build import PrepareOptions, prepare_package
    from prepare.source import SourceError
    from runtime.package import open_package
    from tests.tp_harness import load_runner

    ckpt = _kv_scheme_checkpoint(tmp_path / "a", tokenizer_dir, [0.5, 0.125], [2.0, 0.25])
    out = prepare_package(ckpt, tmp_path / "pkg", PrepareOptions(tp=3), progress=False)
    pkg = open_package(out)
    assert pkg.manifest.quantization.kv_cache == "fp8-e4m3"  # the checkpoint's choice
    assert pkg.kv_quant("auto").k_scales == (0.5, 0.125)
    assert pkg.kv_quant("fp8").v_scales == (2.0, 0.25)
    assert pkg.kv_quant("model") is None
    runner, _ = load_runner(str(out), rank=1, num_pages=4)
    assert runner.kv.dtype == FP8 and runner.kv.scales(1) == (0.125, 0.25)

    partial = _kv_scheme_checkpoint(tmp_path / "b", tokenizer_dir, [0.5, None], [2.0, 0.25])
    with pytest.raises(SourceError, match="self_attn.k_scale for some layers but not layer 1"):
        prepare_package(partial, tmp_path / "pkg-b", PrepareOptions(), progress=False)
    assert not (tmp_path / "pkg-b").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: setattr(q, "kv_cache", "int4"), "kv_cache 'int4' is not 'fp8-e4m3'"),
        (lambda q: q.kv_k_scales.extend([1.0]), "kv_k_scales has 1 values; it needs one per"),
        (lambda q: (q.kv_k_scales.extend([1, 1]), q.kv_v_scales.extend([1, -1])), "not > 0"),
    ],
)
def test_manifest_kv_fields_are_checked(edit, message, tiny_checkpoints, package_cache, tmp_path):
    import shutil

    from runtime.package import MANIFEST_NAME, PackageError, open_package, read_manifest

    pkg = tmp_path / "pkg"
    shutil.copytree(package_cache(tiny_checkpoints["llama"], 1), pkg)
    m = read_manifest(pkg)
    assert m.model.num_layers == 2
    edit(m.quantization)
    (pkg / MANIFEST_NAME).write_bytes(m.SerializeToString())
    with pytest.raises(PackageError, match=message):
        open_package(pkg)


def test_smollm2_with_fp8_kv_stays_close_to_bf16_kv(smollm2_path, package_cache, tmp_path):
    """The real SmolLM2 (bf16 weights) at TP 1 and 3: teacher-forced log-likelihood of 2,000
    tokens of English with FP8 pages (unit scales: its keys and values stay inside +-448) within
    2% of bf16 pages' (the bound the issue sets for FP8 weights; measured 1.05% at TP 1, 1.34% at
    TP 3, and 0.9-1.2% at TP 1
    with per-layer scales calibrated on the same text: e4m3's 3-bit mantissa, not the scale, is
    what costs). Greedy chat answers are printed, not held: the first parts at token 0 (a near
    tie) on one of the two prompts, after 8 tokens on the other."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    tokens = _english_tokens(tok, 2000)
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]
    common = dict(dtype="bfloat16", max_batch=4, max_seq_len=2048)
    for tp in (1, 3):
        pkg = package_cache(smollm2_path, tp, **common)
        ll_bf16 = score_tp(pkg, tp, tokens, chunk=512, tmp=tmp_path, kv_dtype="model")
        ll_fp8 = score_tp(pkg, tp, tokens, chunk=512, tmp=tmp_path, kv_dtype="fp8")
        bf16 = [r["ids"] for r in run_tp(pkg, tp, prompts, 24, 64, tmp_path, kv_dtype="model")]
        fp8 = [r["ids"] for r in run_tp(pkg, tp, prompts, 24, 64, tmp_path, kv_dtype="fp8")]
        agree = [_common_prefix(a, b) for a, b in zip(fp8, bf16)]
        print(f"tp {tp}: log-likelihood fp8 KV {ll_fp8:.1f} vs bf16 KV {ll_bf16:.1f}; {agree}")
        assert ll_fp8 != ll_bf16  # the pages really were FP8
        assert abs(ll_fp8 - ll_bf16) <= 0.02 * abs(ll_bf16), (tp, ll_fp8, ll_bf16)


def test_serve_with_fp8_kv_pages(tiny_checkpoints, tmp_path):
    """`orbit prepare --kv-dtype fp8`, served at TP 2 with the package's choice: twice the KV
    pages of `--kv-dtype model` in the same memory (bf16 package), and greedy text through the
    openai client equal to the reference forward over FP8 pages. A bad --kv-dtype is refused
    at start."""
    from tests.test_serve_checkpoint import _complete, _start, _stop

    out = tmp_path / "pkg"
    cmd = [sys.executable, "-m", "orbit", "prepare", str(tiny_checkpoints["llama"])]
    cmd += ["--out", str(out), "--tp", "2", "--dtype", "bfloat16", "--kv-dtype", "fp8"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    bad = subprocess.run(
        [sys.executable, "-m", "orbit", "serve", str(out), "--kv-dtype", "int4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and "--kv-dtype 'int4' is not one of auto, fp8, model" in bad.stderr

    prompt = [1, 17, 33, 250, 9, 4, 77]
    [want] = run_tp(out, 2, [prompt], 12, chunk=64, tmp=tmp_path, kv_dtype="fp8")
    pages, said = {}, {}
    for kv_dtype in ("auto", "model"):
        args = ("--kv-cache-mb", "1", "--kv-dtype", kv_dtype, "--api-servers", "1")
        server, _ = _start(out, *args)
        try:
            pages[kv_dtype] = server.metrics()["orbit_kv_pages_total"]
            if kv_dtype == "auto":
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
                expected = tok.decode(want["ids"], skip_special_tokens=True)
                assert _complete(server, prompt, 12) == expected
        finally:
            said[kv_dtype] = _stop(server)
    assert pages["auto"] == 2 * pages["model"], pages
    # the start-up line (wrapped to the terminal by rich) says what the pages hold, as the
    # ranks' Ready reported it
    lines = {k: " ".join(v.split()) for k, v in said.items()}
    assert f"{pages['auto']:.0f} KV pages of float8_e4m3fn)" in lines["auto"]
    assert f"{pages['model']:.0f} KV pages of bfloat16)" in lines["model"]


def test_orbit_up_passes_the_kv_dtype_to_its_ranks():
    """`orbit up --kv-dtype fp8` reaches each rank's command line and changes the launch
    fingerprint (a running cluster with other pages is restarted, not reused); the default adds
    nothing, so clusters brought up before the flag existed keep their fingerprint."""
    from orbit.cluster.config import parse_cluster_config
    from orbit.cluster.up import UpOptions, launch_fingerprint
    from ranks.config import RankConfig
    from tests.rank_argv import cluster_rank_argv

    def argv(kv_dtype: str) -> list[str]:
        return cluster_rank_argv(kv_dtype=kv_dtype)

    assert RankConfig.from_argv(argv("fp8")[3:]).kv_dtype == "fp8"
    assert "--kv-dtype" not in argv("auto")
    assert RankConfig.from_argv(argv("auto")[3:]).kv_dtype == "auto"
    config = parse_cluster_config('package = "pkg"\n\n[[hosts]]\naddress = "gpu-a"\n')
    default = launch_fingerprint(config, UpOptions())
    assert launch_fingerprint(config, UpOptions(kv_dtype="auto")) == default
    assert launch_fingerprint(config, UpOptions(kv_dtype="fp8")) != default
