"""The former home of the benchmark helpers, kept so that ``from fastbert import benchmarking as bm`` goes on
working: every public name it held, re-exported from where it lives now. New code imports from those modules:

- `fastbert.bench` (costs, timing, machine, recording, workloads, peers, e2e, report): see its docstring;
- `fastbert.resolve`: checkpoint, device and dtype from what the user named, `UserError`;
- `fastbert.text`: sample sentences, the tokenizer wrapper, mean pooling.
"""

from fastbert.bench.costs import (
    OpCost,
    attention_cost,
    batch_flops,
    embedding_layernorm_cost,
    encoder_flops_per_token,
    linear_activation_cost,
    linear_residual_layernorm_cost,
    qkv_projection_cost,
)
from fastbert.bench.e2e import RESULT_SCHEMA, TIMING_NOTE, BenchSettings, quick_settings, run_e2e
from fastbert.bench.machine import machine_info, machine_tag
from fastbert.bench.peers import DEFAULT_PEERS, PEERS, PeerUnavailable, build_peer, load_fastbert, load_hf_model
from fastbert.bench.recording import OPS, backend_availability, backends_used, record_backends
from fastbert.bench.report import (
    DEFAULT_OUT_ROOT,
    TABLE_HEADERS,
    default_out_dir,
    format_table,
    grouped_bars,
    markdown_report,
    plot_results,
    result_rows,
    summary_lines,
    write_results,
)
from fastbert.bench.timing import measure_peak_flops, percentile, synchronize, time_ms
from fastbert.bench.workloads import Workload, make_workloads
from fastbert.resolve import (
    DTYPES,
    UserError,
    best_device,
    default_model_dir,
    model_name,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from fastbert.text import SENTENCES, TOKENIZER_FILES, TextEncoder, mean_pool

__all__ = [
    "DEFAULT_OUT_ROOT", "DEFAULT_PEERS", "DTYPES", "OPS", "PEERS", "RESULT_SCHEMA", "SENTENCES", "TABLE_HEADERS",
    "TIMING_NOTE", "TOKENIZER_FILES", "BenchSettings", "OpCost", "PeerUnavailable", "TextEncoder", "UserError",
    "Workload", "attention_cost", "backend_availability", "backends_used", "batch_flops", "best_device", "build_peer",
    "default_model_dir", "default_out_dir", "embedding_layernorm_cost", "encoder_flops_per_token", "format_table",
    "grouped_bars", "linear_activation_cost", "linear_residual_layernorm_cost", "load_fastbert", "load_hf_model",
    "machine_info", "machine_tag", "make_workloads", "markdown_report", "mean_pool", "measure_peak_flops",
    "model_name", "percentile", "plot_results", "qkv_projection_cost", "quick_settings", "record_backends",
    "resolve_device", "resolve_dtype", "resolve_model", "result_rows", "run_e2e", "summary_lines", "synchronize",
    "time_ms", "write_results",
]
