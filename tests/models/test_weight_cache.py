"""The weight cache: the model's dequantized weights kept on disk, so that loading it again is fast.

Most tests run on a tiny GGUF file written here (two layers, float32 tensors), through
``loading.load_weights``, the cached path of ``load_model``: they take a second each. The tests
marked ``slow`` load SmolLM2 itself, once cold per dtype (module fixture). Every test points
``LLMU_CACHE`` at a temporary folder: the user's own cache is never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from llmu import cache as llmu_cache
from llmu.models import loading, weight_cache
from llmu.models.gguf_file import GGUFFile
from llmu.models.llama import tiny_llama
from llmu.models.loading import build_from_gguf, hf_name, load_weights, permute_rope_rows
from llmu.models.weight_cache import WeightCacheWarning

REPO = Path(__file__).resolve().parents[2]

# llmu / Hugging Face block names -> GGUF's (the inverse of loading.GGUF_TO_HF)
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path: Path, seed: int = 0):
    """A llama GGUF file holding :func:`tiny_llama`'s weights (tied embeddings, Q/K rows in
    llama.cpp's order, as the converter stores them); returns that model."""
    import gguf

    model = tiny_llama(seed, tie_word_embeddings=True)
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied: the file has no output.weight
            continue
        if name.endswith("q_proj.weight"):
            t = permute_rope_rows(t, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = permute_rope_rows(t, c.num_key_value_heads)
        assert hf_name(_gguf_name(name)) == name
        w.add_tensor(_gguf_name(name), t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty llmu cache folder of the test's own; returns where weight files go."""
    monkeypatch.setenv("LLMU_CACHE", str(tmp_path / "llmu-cache"))
    return tmp_path / "llmu-cache" / "models"


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, torch.nn.Module]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def _uncached(path: Path, dtype=torch.float32):
    """What ``build_from_gguf`` does, step by step (tests/conftest.py counts a call of
    ``build_from_gguf`` itself as loading SmolLM2, which these fast tests do not)."""
    with GGUFFile(path) as f:
        config = f.config
        state = dict(loading.gguf_state_dict(f, dtype=dtype))
    return loading.assemble(config, state, dtype=dtype)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _load_quietly(path, **kw):
    """load_weights, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_weights(path, **kw)


def _load_with_one_warning(path, match: str, **kw):
    with pytest.warns(WeightCacheWarning, match=match) as record:
        out = load_weights(path, **kw)
    ours = [str(w.message) for w in record if issubclass(w.category, WeightCacheWarning)]
    assert len(ours) == 1, ours
    return out


# ---------------------------------------------------------------------------------------------
# where the cache is
# ---------------------------------------------------------------------------------------------

def test_cache_dir_is_llmu_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMU_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert llmu_cache.cache_dir("models") == tmp_path / "home" / ".cache" / "llmu" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec says: ignore a relative path
    assert llmu_cache.cache_dir() == tmp_path / "home" / ".cache" / "llmu"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert llmu_cache.cache_dir("models") == tmp_path / "xdg" / "llmu" / "models"
    monkeypatch.setenv("LLMU_CACHE", str(tmp_path / "mine"))
    assert llmu_cache.cache_dir("models") == tmp_path / "mine" / "models"
    assert weight_cache.folder() == tmp_path / "mine" / "models"


def test_gpu_compile_keeps_its_kernels_in_the_same_cache_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LLMU_GPU_COMPILE_CACHE"}
    env["LLMU_CACHE"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import llmu.gpu_compile as g; print(g.CACHE_DIR)"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    assert out.strip() == str(tmp_path / "gpu-compile")


# ---------------------------------------------------------------------------------------------
# first load writes, later loads map
# ---------------------------------------------------------------------------------------------

def test_first_load_writes_the_cache_and_the_next_maps_it(cache, tiny, monkeypatch):
    path, original = tiny
    cold, source = _load_quietly(path)
    assert source == "gguf"
    (file,) = _weight_files(cache)
    sha = weight_cache.file_sha256(path)
    assert sha[:16] in file.name and f"loader{loading.LOADER_VERSION}" in file.name and "float32" in file.name

    # the next load reads neither the GGUF tensors nor its metadata
    monkeypatch.setattr(loading, "gguf_state_dict", lambda *a, **k: pytest.fail("dequantized again"))
    monkeypatch.setattr(loading, "GGUFFile", lambda *a, **k: pytest.fail("GGUF file parsed again"))
    warm, source = _load_quietly(path)
    assert source == "cache"
    assert warm.config.to_dict() == cold.config.to_dict()
    _assert_same_weights(warm, cold)
    _assert_same_weights(warm, original)  # the Q/K rows are back in Hugging Face order
    assert warm.lm_head.weight is warm.embed_tokens.weight  # tied: one tensor
    assert cold.lm_head.weight is cold.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_model_equals_the_uncached_one_bit_for_bit(cache, tiny, dtype):
    path, _ = tiny
    reference = _uncached(path, dtype)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    for expected_source in ("gguf", "cache"):
        model, source = _load_quietly(path, dtype=dtype)
        assert source == expected_source
        _assert_same_weights(model, reference)
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, reference(ids).logits)


def test_the_key_is_the_file_content_the_loader_version_and_the_dtype(cache, tmp_path, monkeypatch):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_gguf(a, seed=0)
    write_tiny_gguf(b, seed=0)
    _load_quietly(a)
    assert _load_quietly(b)[1] == "cache"  # another path, the same bytes: the same weights
    write_tiny_gguf(b, seed=1)
    model_b, source = _load_quietly(b)  # same name, other bytes
    assert source == "gguf"
    _assert_same_weights(model_b, _uncached(b))
    assert _load_quietly(a, dtype=torch.bfloat16)[1] == "gguf"
    monkeypatch.setattr(loading, "LOADER_VERSION", loading.LOADER_VERSION + 1)
    assert _load_quietly(a)[1] == "gguf"
    assert len(_weight_files(cache)) == 4


def test_in_place_changes_never_reach_the_file(cache, tiny):
    path, _ = tiny
    _load_quietly(path)
    first, _ = _load_quietly(path)
    second, _ = _load_quietly(path)
    with torch.no_grad():
        first.layers[0].mlp.up_proj.weight.mul_(0)
        first.embed_tokens.weight.add_(1)
    _assert_same_weights(second, _uncached(path))
    third, source = _load_quietly(path)
    assert source == "cache"
    _assert_same_weights(third, _uncached(path))


# ---------------------------------------------------------------------------------------------
# a damaged file is rebuilt, an unwritable folder skipped, each with one warning
# ---------------------------------------------------------------------------------------------

def _truncate(file: Path):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])


def _garble_header(file: Path):
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32
    file.write_bytes(bytes(data))


def _drop_a_tensor(file: Path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as f:
        meta, state = f.metadata(), f.get_tensors()
    del state["layers.1.mlp.down_proj.weight"]
    save_file(state, str(file), metadata=meta)


def _other_shapes_in_header(file: Path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as f:
        meta, state = f.metadata(), f.get_tensors()
    state["norm.weight"] = state["norm.weight"][:-1].clone()
    shapes = json.loads(meta["llmu.tensors"])
    shapes["norm.weight"] = list(state["norm.weight"].shape)
    meta["llmu.tensors"] = json.dumps(shapes)
    meta["llmu.total_bytes"] = str(sum(t.numel() * t.element_size() for t in state.values()))
    save_file(state, str(file), metadata=meta)  # consistent with itself, not with the config


def _empty(file: Path):
    file.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _garble_header, _drop_a_tensor, _other_shapes_in_header, _empty])
def test_a_damaged_cache_file_is_rebuilt_with_one_warning(cache, tiny, damage):
    path, _ = tiny
    reference = _uncached(path)
    _load_quietly(path)
    (file,) = _weight_files(cache)
    damage(file)
    model, source = _load_with_one_warning(path, match="damaged.*rebuilding")
    assert source == "gguf"
    _assert_same_weights(model, reference)
    model, source = _load_quietly(path)  # rebuilt: used again, no warning
    assert source == "cache"
    _assert_same_weights(model, reference)


def test_a_cache_file_with_another_key_in_its_header_is_not_used(cache, tiny):
    path, _ = tiny
    _load_quietly(path, dtype=torch.bfloat16)
    _load_quietly(path, dtype=torch.float32)
    bf16, fp32 = sorted(_weight_files(cache))
    os.replace(bf16, fp32)  # a bfloat16 file under the float32 name
    model, source = _load_with_one_warning(path, match="dtype")
    assert source == "gguf" and model.dtype == torch.float32


def test_a_cache_folder_that_cannot_be_made_costs_one_warning(tmp_path, monkeypatch, tiny):
    path, _ = tiny
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LLMU_CACHE", str(blocker / "cache"))  # mkdir fails, even for root
    model, source = _load_with_one_warning(path, match="could not write.*LLMU_CACHE")
    assert source == "gguf"
    _assert_same_weights(model, _uncached(path))
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_cache_folder_costs_one_warning(cache, tiny):
    path, _ = tiny
    cache.mkdir(parents=True)
    cache.chmod(0o500)
    try:
        model, source = _load_with_one_warning(path, match="could not write")
    finally:
        cache.chmod(0o700)
    assert source == "gguf" and not list(cache.iterdir())


def _safetensors_error(message):
    from safetensors import SafetensorError

    return SafetensorError(message)


@pytest.mark.parametrize("error", [lambda m: OSError(28, m), _safetensors_error])
def test_a_failed_write_leaves_no_temporary_file(cache, tiny, monkeypatch, error):
    """A full disk, as Python reports it and as safetensors does (its own error type)."""
    path, _ = tiny

    def disk_full(*args, **kwargs):
        Path(args[1]).write_bytes(b"partial")
        raise error("No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    _, source = _load_with_one_warning(path, match="No space left")
    assert source == "gguf" and list(cache.iterdir()) == []


def test_temporary_files_of_killed_writers_are_cleaned_up(cache, tiny):
    path, _ = tiny
    cache.mkdir(parents=True)
    stale = [cache / ".x.safetensors.123-abcd.tmp", cache / ".tmpAbC123"]  # ours, safetensors' own
    young = [cache / ".y.safetensors.456-ef01.tmp", cache / ".tmpXyZ789"]
    for temp in stale + young:
        temp.write_bytes(b"half a file")
    old = time.time() - 2 * weight_cache.STALE_TEMP_S
    for temp in stale:
        os.utime(temp, (old, old))
    _load_quietly(path)
    assert not any(temp.exists() for temp in stale)
    assert all(temp.exists() for temp in young)  # maybe another process writing right now


def test_two_processes_writing_at_once_leave_one_good_file(cache, tiny, tmp_path):
    """Both start cold, and neither renames its temporary file before both have written one; both
    load the same weights, and the file left is whole."""
    path, _ = tiny
    go, ready = tmp_path / "go", tmp_path / "ready"
    ready.mkdir()
    script = textwrap.dedent(f"""
        import glob, os, time, warnings
        from llmu.models import loading, weight_cache
        warnings.simplefilter("error", weight_cache.WeightCacheWarning)
        real_replace = os.replace
        def barrier(step):  # wait until both processes got here
            open(os.path.join({str(ready)!r}, f"{{step}}-{{os.getpid()}}"), "w").close()
            deadline = time.time() + 120
            while len(glob.glob(os.path.join({str(ready)!r}, f"{{step}}-*"))) < 2 and time.time() < deadline:
                time.sleep(0.01)
        def replace_when_both_have_written(src, dst):
            barrier("written")
            print("temporaries", len(glob.glob(os.path.join(os.path.dirname(dst), ".*.tmp"))))
            barrier("counted")
            real_replace(src, dst)
        weight_cache.os.replace = replace_when_both_have_written
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        model, source = loading.load_weights({str(path)!r})
        print(source, float(sum(p.double().sum() for p in model.parameters())))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    time.sleep(0.5)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert [out.split()[:3] for out, _ in outs] == [["temporaries", "2", "gguf"]] * 2  # both wrote at once
    assert outs[0][0].split()[3] == outs[1][0].split()[3]  # and loaded the same weights
    assert [f.name for f in cache.iterdir() if f.name.startswith(".")] == []  # no temporary left
    (file,) = _weight_files(cache)
    model, source = _load_quietly(path)
    assert source == "cache"
    _assert_same_weights(model, _uncached(path))


# ---------------------------------------------------------------------------------------------
# llmu doctor and the benchmark entry
# ---------------------------------------------------------------------------------------------

def test_doctor_says_where_the_cache_is_and_how_big(cache, tiny):
    from llmu import cli

    path, _ = tiny
    line = cli._check_model_cache()
    assert line.ok and not line.warning and str(cache) in line.detail and "0 files" in line.detail
    _load_quietly(path)
    line = cli._check_model_cache()
    size = sum(f.stat().st_size for f in cache.iterdir())
    assert f"1 file, {size / 2**20:.0f} MiB" in line.detail and str(cache) in line.detail


def test_doctor_warns_when_the_cache_cannot_be_written(tmp_path, monkeypatch):
    from llmu import cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LLMU_CACHE", str(blocker / "cache"))
    line = cli._check_model_cache()
    assert line.ok and line.warning and "not writable" in line.detail and "LLMU_CACHE" in line.fix


def test_doctor_reports_the_cache():
    from io import StringIO

    from llmu import cli

    out = StringIO()
    cli.doctor(load_model=False, out=out)
    assert " model cache " in out.getvalue()


def test_load_benchmark_is_registered_and_times_cold_then_warm(tiny, cache, monkeypatch):
    from llmu.bench.registry import load_all
    from llmu.models import bench

    assert load_all()["model_load_s"].run is bench._run_load
    path, _ = tiny
    seconds = bench.time_loads(path=path, providers=("llmu cold", "llmu warm"))
    assert set(seconds) == {"llmu cold", "llmu warm"} and all(s > 0 for s in seconds.values())
    assert not cache.exists()  # the measurement's cache was a temporary folder, removed
    assert os.environ["LLMU_CACHE"] == str(cache.parent)


def test_load_benchmark_skips_transformers_when_it_is_not_installed(monkeypatch):
    from llmu.models import bench

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(bench, "time_loads", lambda dtype, device, providers, real=bench.time_loads:
                        {p: 1.0 for p in providers} if "transformers" not in providers
                        else real(dtype, device, providers=providers))
    rows = bench._run_load({}, torch.device("cpu"))
    by = {r["provider"]: r for r in rows}
    assert by["transformers"]["status"] == "skipped" and "not installed" in by["transformers"]["reason"]
    assert by["llmu cold"]["ms"] == 1e3 and by["llmu warm"]["ms"] == 1e3


# ---------------------------------------------------------------------------------------------
# SmolLM2 itself
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """LLMU_CACHE at a folder of this module's, filled by one cold load per dtype (fresh models)."""
    folder = tmp_path_factory.mktemp("llmu-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMU_CACHE", str(folder))
        sources = {}
        for dtype in (torch.float32, torch.bfloat16):
            loading.load_model(dtype=dtype, device="cpu", fresh=True)
            sources[dtype] = loading.LAST_LOAD_SOURCE
        yield folder, sources


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_from_the_cache_equals_the_uncached_model(smollm2_cache, monkeypatch, dtype):
    folder, cold_sources = smollm2_cache
    monkeypatch.setenv("LLMU_CACHE", str(folder))
    assert cold_sources[dtype] == "gguf"
    model = loading.load_model(dtype=dtype, device="cpu", fresh=True)
    assert loading.LAST_LOAD_SOURCE == "cache"
    assert model.lm_head.weight is model.embed_tokens.weight
    reference = build_from_gguf(dtype=dtype, device="cpu")
    _assert_same_weights(model, reference)
    ids = torch.tensor([[1, 504, 3458, 314, 2114, 30]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_smollm2_fresh_models_from_the_cache_are_independent(smollm2_cache, monkeypatch):
    folder, _ = smollm2_cache
    monkeypatch.setenv("LLMU_CACHE", str(folder))
    a = loading.load_model(device="cpu", fresh=True)
    b = loading.load_model(device="cpu", fresh=True)
    assert loading.LAST_LOAD_SOURCE == "cache"
    before = b.layers[3].self_attn.q_proj.weight.clone()
    with torch.no_grad():
        a.layers[3].self_attn.q_proj.weight.zero_()
    assert torch.equal(b.layers[3].self_attn.q_proj.weight, before)
    c = loading.load_model(device="cpu", fresh=True)
    assert torch.equal(c.layers[3].self_attn.q_proj.weight, before)
