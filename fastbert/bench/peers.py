"""The implementations fastbert is measured against, each loaded as a callable inputs -> last_hidden_state:
transformers eager and SDPA (`load_hf_model`), torch.compile, ONNX Runtime (export, optional fusion by its BERT
optimizer, session: `onnxruntime_runner`), and fastbert itself (`load_fastbert`, or fastbert.optimize of the HF
model). A peer that cannot run here raises `PeerUnavailable` with the reason shown in the results.

transformers and onnxruntime are imported inside the functions that need them."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable

import torch

from fastbert.bench.machine import package_version, version_tuple
from fastbert.bench.workloads import Workload
from fastbert.common.resolve import dtype_name
from fastbert.config import FastBertConfig
from fastbert.cpu import native_bf16

# fastbert-static: fastbert's own model with `auto` by its static order (measuring off), against fastbert's `auto`
# measured (`fastbert.backends.tuning`) in the same run.
PEERS = ("hf-eager", "hf-sdpa", "compile", "onnxruntime", "onnxruntime-int8", "openvino", "openvino-default",
         "fastbert-optimize", "fastbert-static", "fastbert-int8", "fastbert-bf16")
DEFAULT_PEERS = ("hf-eager", "hf-sdpa", "compile", "onnxruntime")


class PeerUnavailable(Exception):
    """A peer that cannot run here; the message is the reason shown in the results."""


class _HFLastHidden(torch.nn.Module):
    """HF model -> last_hidden_state, positional inputs (for the ONNX exporter)."""

    def __init__(self, model: torch.nn.Module, token_types: bool):
        super().__init__()
        self.model = model
        self.token_types = token_types

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {"token_type_ids": token_type_ids} if self.token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def export_onnx(model_dir: str, config: FastBertConfig, dtype: torch.dtype, device: torch.device, workdir: str,
                optimize: bool, opt_level: int | None = 0) -> tuple[str, list[str]]:
    """Export the HF model (eager attention) with dynamic batch and sequence axes through the TorchScript-based
    exporter (``dynamo=False``: the torch.export one needs onnxscript), then optionally fuse it with
    onnxruntime.transformers.optimizer(model_type="bert", opt_level=opt_level; None: the optimizer's default).
    Returns (path, notes)."""
    notes = []
    hf = load_hf_model(model_dir, "eager", dtype, device)
    # The exporter restores the wrapper's training flag after export; a fresh nn.Module is in training mode,
    # which would switch dropout on for every later call of the HF model: eval() first.
    wrapper = _HFLastHidden(hf, bool(config.type_vocab_size)).eval()
    example = Workload("export", 2, 8, [8, 5], True).inputs(config, device)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if config.type_vocab_size else [])
    path = os.path.join(workdir, "model.onnx")
    axes = {name: {0: "batch", 1: "sequence"} for name in names + ["last_hidden_state"]}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, tuple(example[n] for n in names), path, input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
    notes.append("torch.onnx.export(dynamo=False), opset 17")
    del hf, wrapper
    if optimize:
        try:
            from onnxruntime.transformers import optimizer

            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fused = optimizer.optimize_model(path, model_type="bert", num_heads=config.num_attention_heads,
                                                 hidden_size=config.hidden_size, opt_level=opt_level,
                                                 use_gpu=device.type == "cuda")
                fused_path = os.path.join(workdir, "model_opt.onnx")
                fused.save_model_to_file(fused_path)
            counts = fused.get_fused_operator_statistics()
            kept = {k: v for k, v in counts.items() if v}
            fusions = ", ".join(f"{k} {v}" for k, v in sorted(kept.items())) or "no fusion"
            notes.append(f"onnxruntime.transformers optimizer (bert): {fusions}")
            path = fused_path
        except Exception as err:  # noqa: BLE001 - an optimizer failure leaves the plain export, with the reason
            notes.append(f"optimizer failed, plain export used: {type(err).__name__}: {str(err)[:120]}")
    return path, notes


def build_peer(name: str, model_dir: str, config: FastBertConfig, dtype: torch.dtype, device: torch.device,
               backend: str, quick: bool, workdir: str) -> tuple[Callable[[dict], torch.Tensor], list[str]]:
    """A callable inputs -> last_hidden_state [B, S, H] for the named implementation, plus notes on how it runs.
    Raises PeerUnavailable (with the reason) when it cannot run here."""
    if name == "fastbert":
        model = load_fastbert(model_dir, dtype, device, backend)
        return (lambda inputs: model(**inputs).last_hidden_state), [f"from_pretrained(backend={backend!r})"]
    if name == "fastbert-static":
        from fastbert import backends

        model = load_fastbert(model_dir, dtype, device, backend)

        def static(inputs: dict) -> torch.Tensor:
            with backends.measuring(False):  # its op tables resolve by the static order and keep that
                return model(**inputs).last_hidden_state

        return static, [f"from_pretrained(backend={backend!r}), auto by the static order (measuring off)"]
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise PeerUnavailable(f"transformers is not installed ({err})") from err
    if name in ("hf-eager", "hf-sdpa"):
        model = load_hf_model(model_dir, name.split("-")[1], dtype, device)
        return (lambda inputs: model(**inputs).last_hidden_state), [f"AutoModel(attn_implementation={name[3:]!r})"]
    if name in ("fastbert-int8", "fastbert-bf16"):
        return fastbert_precision_peer(name, model_dir, device, backend)
    if name == "fastbert-optimize":
        import fastbert

        model = fastbert.optimize(load_hf_model(model_dir, "eager", dtype, device), backend=backend)
        return (lambda inputs: model(**inputs).last_hidden_state), ["fastbert.optimize(AutoModel eager)"]
    if name == "compile":
        if not hasattr(torch, "compile"):
            raise PeerUnavailable("torch.compile is not available in this torch")
        model = load_hf_model(model_dir, "sdpa", dtype, device)
        try:
            compiled = torch.compile(model, dynamic=False)
        except Exception as err:  # reported as the peer's reason
            raise PeerUnavailable(f"torch.compile failed: {type(err).__name__}: {str(err)[:160]}") from err
        return (lambda inputs: compiled(**inputs).last_hidden_state), [
            "torch.compile(AutoModel sdpa, dynamic=False); compile time excluded (warm-up)"]
    if name == "onnxruntime":
        return onnxruntime_runner(model_dir, config, dtype, device, workdir, optimize=not quick)
    if name == "onnxruntime-int8":
        return onnxruntime_runner(model_dir, config, dtype, device, workdir, opt_level=None, quantize=True)
    if name in ("openvino", "openvino-default"):
        return openvino_runner(model_dir, config, device, workdir, "f32" if name == "openvino" else None)
    raise PeerUnavailable(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


def fastbert_precision_peer(name: str, model_dir: str, device: torch.device,
                            backend: str) -> tuple[Callable[[dict], torch.Tensor], list[str]]:
    """fastbert int8 (`fastbert.quantization`) or bfloat16 from_pretrained; bfloat16 on a CPU only where the CPU
    computes it natively (AMX, AVX-512 BF16; `fastbert.cpu.native_bf16`), even where ``dtype="auto"`` measured it
    slower than float32 (a user may still want its memory): elsewhere it is emulated, and not what anyone would run,
    so the peer is "not available" with that reason."""
    from fastbert.quantization import int8_unavailable

    if name == "fastbert-int8":
        reason = int8_unavailable(device)
        if reason:
            raise PeerUnavailable(reason)
        model = load_fastbert(model_dir, "int8", device, backend)
        return (lambda inputs: model(**inputs).last_hidden_state), [
            f"from_pretrained(dtype='int8', backend={backend!r})"]
    require_native_bf16(device)
    model = load_fastbert(model_dir, torch.bfloat16, device, backend)
    return (lambda inputs: model(**inputs).last_hidden_state.float()), [
        f"from_pretrained(dtype=bfloat16, backend={backend!r})"]


def require_native_bf16(device: torch.device) -> None:
    """PeerUnavailable for a bfloat16 peer on a CPU that would emulate bfloat16 (neither AMX nor AVX-512 BF16)."""
    if device.type == "cpu" and not native_bf16():
        raise PeerUnavailable("bfloat16 would be emulated on this CPU (neither AMX nor AVX-512 BF16), slower than "
                              "float32")


def openvino_runner(model_dir: str, config: FastBertConfig, device: torch.device, workdir: str,
                    precision: str | None) -> tuple[Callable[[dict], torch.Tensor], list[str]]:
    """The plain ONNX export (`export_onnx`, no ONNX Runtime fusion: its contrib ops are not standard ONNX) compiled
    by OpenVINO for its CPU plugin with torch's thread count; ``precision`` "f32" pins float32
    (INFERENCE_PRECISION_HINT), None keeps OpenVINO's default (bf16 on CPUs with AMX/AVX-512 BF16, else f32)."""
    if device.type != "cpu":
        raise PeerUnavailable("OpenVINO is benchmarked on CPU only")
    try:
        import openvino as ov
    except ImportError as err:
        raise PeerUnavailable(f"openvino is not installed ({err})") from err
    try:
        path, notes = export_onnx(model_dir, config, torch.float32, device, workdir, optimize=False)
    except Exception as err:  # export failures become the peer's reason
        raise PeerUnavailable(f"ONNX export failed: {type(err).__name__}: {str(err)[:160]}") from err
    properties = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY"}
    if precision is not None:
        properties["INFERENCE_PRECISION_HINT"] = precision
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", properties)
    request = compiled.create_infer_request()
    names = [port.get_any_name() for port in compiled.inputs]
    chosen = compiled.get_property("INFERENCE_PRECISION_HINT")
    chosen = chosen.get_type_name() if hasattr(chosen, "get_type_name") else chosen  # an ov.Type: 'f32', 'bf16'
    notes.append(f"openvino {ov.__version__} CPU plugin, {torch.get_num_threads()} threads, LATENCY hint, inference "
                 f"precision {chosen} ({'pinned' if precision else 'its default'})")

    def run(inputs: dict) -> torch.Tensor:
        result = request.infer({n: inputs[n].cpu().numpy() for n in names})
        return torch.from_numpy(result[compiled.outputs[0]].copy()).to(device)

    return run, notes


def onnxruntime_runner(model_dir: str, config: FastBertConfig, dtype: torch.dtype, device: torch.device,
                       workdir: str, optimize: bool = True, opt_level: int | None = 0, spinning: bool = False,
                       quantize: bool = False) -> tuple[Callable[[dict], torch.Tensor], list[str]]:
    """The checkpoint exported to ONNX (`export_onnx`) in an ONNX Runtime session with as many intra-op threads as
    torch uses on CPU: a callable inputs -> last_hidden_state, plus notes. ``spinning``: let idle worker threads
    spin between calls (ONNX Runtime's default; off here unless asked). ``quantize``: the (BERT-optimized) graph
    through ``onnxruntime.quantization.quantize_dynamic`` with its defaults (int8 weights per tensor, uint8
    activations with one dynamic scale per tensor). Raises PeerUnavailable when it cannot run."""
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise PeerUnavailable(f"onnxruntime is not installed ({err})") from err
    available = ort.get_available_providers()
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise PeerUnavailable(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                                  f"(providers: {', '.join(available)})")
        providers = ["CUDAExecutionProvider"]
    else:
        if dtype != torch.float32:
            raise PeerUnavailable(f"onnxruntime's CPU provider is benchmarked in float32 only, not "
                                  f"{dtype_name(dtype)}")
        providers = ["CPUExecutionProvider"]
    try:
        path, notes = export_onnx(model_dir, config, dtype, device, workdir, optimize, opt_level)
    except Exception as err:  # export failures become the peer's reason
        raise PeerUnavailable(f"ONNX export failed: {type(err).__name__}: {str(err)[:160]}") from err
    if quantize:
        path = _ort_quantized(path, workdir, notes)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not spinning:
        # Idle ORT threads would spin between calls and steal the cores from the implementation timed next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if device.type == "cpu":
        options.intra_op_num_threads = torch.get_num_threads()  # the same threads torch uses
    session = ort.InferenceSession(path, options, providers=providers)
    names = [i.name for i in session.get_inputs()]
    notes.append(f"{providers[0]}, {options.intra_op_num_threads or 'default'} intra-op threads"
                 + (", idle threads spinning" if spinning else "")
                 + ("; inputs and outputs copied host<->device each call" if device.type == "cuda" else ""))

    def run(inputs: dict) -> torch.Tensor:
        feed = {n: inputs[n].cpu().numpy() for n in names}
        return torch.from_numpy(session.run(None, feed)[0]).to(device)

    return run, notes


def _ort_quantized(path: str, workdir: str, notes: list[str]) -> str:
    """ONNX Runtime's dynamic int8 quantization of the graph at ``path`` (its defaults), the new path."""
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = os.path.join(workdir, "model_int8.onnx")
        logging.disable(logging.WARNING)  # its advice to pre-process the graph goes to the root logger
        try:
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # (shape inference cannot type the optimizer's fused ops' outputs: they are float)
                quantize_dynamic(path, quantized, weight_type=QuantType.QInt8,
                                 extra_options={"DefaultTensorType": 1})  # onnx.TensorProto.FLOAT
        finally:
            logging.disable(logging.NOTSET)
    except Exception as err:  # a quantizer failure is the peer's reason
        raise PeerUnavailable(f"onnxruntime quantize_dynamic failed: {type(err).__name__}: {str(err)[:160]}") from err
    notes.append("onnxruntime.quantization.quantize_dynamic(weight_type=QInt8, per_channel=False): int8 weights per "
                 "tensor, uint8 activations per tensor")
    return quantized


def load_hf_model(model_dir: str, attn: str = "eager", dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", model_class: type | None = None) -> torch.nn.Module:
    """transformers' AutoModel (or ``model_class``, e.g. a head class) of a checkpoint, in eval mode, quietly (no
    progress bars or load reports)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    previous = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # transformers renamed torch_dtype to dtype in 4.56; older versions would pass an unknown `dtype` to the config.
    dtype_key = "dtype" if version_tuple(package_version("transformers")) >= (4, 56) else "torch_dtype"
    try:
        with warnings.catch_warnings(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")  # the weight-loading bar and load reports go to the sink
            model = (model_class or AutoModel).from_pretrained(model_dir, attn_implementation=attn,
                                                                 **{dtype_key: dtype})
    finally:
        hf_logging.set_verbosity(verbosity)
        if previous is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = previous
    return model.to(device).eval()


def load_fastbert(model_dir: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  backend: str = "auto") -> torch.nn.Module:
    import fastbert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unused-key notes (e.g. a checkpoint's MLM head) are not news here
        return fastbert.from_pretrained(model_dir, dtype=dtype, device=device, backend=backend)
