"""``fastbert embed``: embeddings of TEXT arguments or of every row of a corpus (`fastbert.embedding`), one output
row per input row, in input order, streaming and resumable; or the cosine similarity matrix of the TEXTs."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fastbert import embedding
from fastbert.bench import report
from fastbert.cli import os_error_line, shared
from fastbert.common.resolve import UserError, check_dir_creatable, check_file_writable
from fastbert.common.text import per_second, plural

if TYPE_CHECKING:
    from fastbert.embedding import Embedder, EmbedStats, FileOutput, ShardedOutput
    from fastbert.embedding.ray import RayClusterEmbedder  # Ray is optional


def run(args: argparse.Namespace) -> int:
    """Embed TEXT arguments or a corpus: one output row per input row, in input order; a summary on stderr."""
    started = time.perf_counter()
    shared.set_threads(args.threads)
    if args.output is not None and args.output_dir is not None:
        raise UserError("give --output or --output-dir, not both")
    if args.output == "-":  # stdout, as '-' is stdin for --input (a file named '-' is ./-)
        args.output = None
    try:
        check_options(args)
        output_format = output_format_of(args)
        embedder, window_rows = build_embedder(args)
        if args.similarity:
            return print_similarity(args, embedder)
        rows, counter, size, stream = input_rows(args)
        output = open_output(args, embedder, output_format, window_rows)
    except BaseException:  # refused options, a model or an input that did not load: a reader of -o FIFO sees its end
        if args.output is not None:
            embedding.release_reader(args.output)
        raise
    initial = None
    if args.resume:
        if output.manifest["complete"]:
            sys.stderr.write(f"fastbert embed: {args.output_dir} is complete ({output.rows_done:,} rows); "
                             "nothing to resume\n")
            return 0
        embedding.skip_rows(rows, output.rows_done)
        initial = output.stats()
        sys.stderr.write(f"fastbert embed: resuming after row {output.rows_done:,} "
                         f"({len(output.manifest['shards'])} shards done)\n")
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = embedding.Progress(size, show, initial=initial)
    error, stats, stopped = None, None, False
    try:
        stats = embedding.run(embedder, rows, output, window_rows, progress,
                              bytes_read=(lambda: counter.bytes_read) if counter is not None else (lambda: 0),
                              blank=args.on_blank, initial=initial)
    except embedding.InputError as err:
        error = err
    except OSError as err:  # a full disk: the rows written before stay valid, and the message says how many
        if isinstance(err, BrokenPipeError):
            raise
        error = os_error_line(err)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was written stays valid; say where, before the CLI's line
        stopped = True
        raise
    finally:
        if stream is not None and stream is not sys.stdin.buffer:
            stream.close()
        output.close(stats)  # stats None: the run stopped early (a sharded run stays resumable)
        if stopped:
            sys.stderr.write(f"fastbert embed: stopped: {stopped_note(args, output)}\n")
    if error is not None:
        if output.rows_done == 0:
            raise UserError(f"{error} (nothing was written)")
        raise UserError(f"{error} ({plural(output.rows_done, 'row')} before it "
                        f"{'was' if output.rows_done == 1 else 'were'} written to {output.describe()} and "
                        f"{'is' if output.rows_done == 1 else 'are'} valid)")
    write_summary(stats, initial, embedder, output, time.perf_counter() - started)
    return 0


def stopped_note(args: argparse.Namespace, output: FileOutput | ShardedOutput) -> str:
    """What an embed run stopped early (Ctrl-C, SIGTERM) leaves: nothing, or its first rows, valid."""
    if output.rows_done == 0:
        return "nothing was written"
    resume = "; --resume continues the run" if args.output_dir is not None else ""
    return f"the first {output.rows_done:,} rows are written to {output.describe()} and are valid{resume}"


def check_options(args: argparse.Namespace) -> None:
    """UserError for options that do not go together, and for an input or output that cannot be used: before the
    model loads, so that a mistake costs no load (minutes on a cluster)."""
    if args.resume and args.output_dir is None:
        raise UserError("--resume continues an --output-dir run; give --output-dir")
    if args.window_rows is not None and args.window_rows < 1:  # 0 would otherwise read as "not given"
        raise UserError("--window-rows must be >= 1")
    ray_options = {"--ray-address": args.ray_address is not None, "--ray-actors": args.ray_actors != 1,
                   "--ray-cpus": args.ray_cpus != 1.0, "--ray-gpus": args.ray_gpus != 0.0}
    given = [option for option, differs in ray_options.items() if differs]
    if given and not args.ray:
        raise UserError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} up the Ray run; add --ray")
    if args.similarity:
        check_similarity_options(args)
        return
    check_input_options(args)
    if args.output_dir is not None:
        check_output_dir(args)
    elif args.output is not None and embedding.is_stream(args.output):  # /dev/stdout, a named pipe, a device
        embedding.check_stream(args.output, output_format_of(args))  # JSONL only; never opened here, nor emptied
    elif args.output is not None:
        parquet = args.format == "parquet" or (args.format is None and args.output.lower().endswith(".parquet"))
        check_file_writable(args.output, "--output", replaced=parquet)  # Parquet: written aside, moved over it
    elif output_format_of(args) != "jsonl":
        raise UserError(f"{args.format} output needs --output FILE or --output-dir (stdout takes JSONL only)")
    if args.output_dtype != "float32" and output_format_of(args) == "jsonl" and not args.resume:
        raise UserError(f"--output-dtype {args.output_dtype} sets the value type of npy and Parquet output (--format "
                        "npy|parquet); JSONL writes decimal numbers")  # (a run resumed keeps what its manifest says)


def check_input_options(args: argparse.Namespace) -> None:
    """UserError for TEXTs with --input, a --input that cannot be read, --id-field on anything but JSONL."""
    if args.texts and args.input is not None:
        raise UserError("give TEXT arguments or --input, not both")
    for option, value in (("--field", args.field), ("--id-field", args.id_field)):
        if value is not None and (args.texts or input_format_of(args) != "jsonl"):
            raise UserError(f"{option} needs JSONL input: a --input named *.jsonl or *.ndjson, or --input-format "
                            "jsonl (stdin and other files are read as text lines)")
    if not args.texts:
        embedding.check_input_path(args.input or "-")
    stdin = args.input in (None, "-")
    name = "stdin" if stdin else f"the --input file {args.input}"
    to_stdout = args.output in (None, "-")
    if to_stdout and same_regular_file(None if stdin else args.input, None):
        raise UserError(f"stdout is {name}: the embeddings would be written into the input while it is read; "
                        "redirect stdout to another file, or give --output")
    if not to_stdout and same_regular_file(None if stdin else args.input, args.output):
        if embedding.is_stream(args.output):  # /dev/stdout redirected to the input: written through, not emptied
            raise UserError(f"--output {args.output} is {name}: the embeddings would be written into the input "
                            "while it is read; write to another file")
        raise UserError(f"--output {args.output} is {name}: writing it would destroy the input before it is read; "
                        "write to another file")


def same_regular_file(input_path: str | None, output_path: str | None) -> bool:
    """Whether the input (None: stdin, ``< corpus.txt``) and the output (None: stdout, ``>> corpus.txt``) are one
    regular file (through links, ./, descriptors and the like; not a terminal that is both stdin and stdout)."""
    try:
        found = os.fstat(0) if input_path is None else os.stat(input_path)
        out = os.fstat(1) if output_path is None else os.stat(output_path)
    except OSError:  # one of them does not exist (yet), or no such descriptor
        return False
    return stat.S_ISREG(found.st_mode) and (found.st_dev, found.st_ino) == (out.st_dev, out.st_ino)


def check_output_dir(args: argparse.Namespace) -> None:
    """UserError for an --output-dir that holds a run (without --resume), none (with it), or one fastbert 0.1.0
    started with --id-field, which counted empty JSONL lines as rows; or one that cannot be written."""
    found = embedding.check_run_directory(args.output_dir, args.resume)
    if found is not None and found["settings"].get("id_field") is not None \
            and "blank_jsonl_lines" not in found["settings"]:
        raise UserError(f"--resume: {args.output_dir} was started by fastbert 0.1.0 with --id-field, which counted "
                        "empty JSONL lines as rows; this version skips them, so it cannot continue that run: start "
                        "it again in a new --output-dir")
    check_dir_creatable(args.output_dir, "--output-dir")


def input_format_of(args: argparse.Namespace) -> str:
    """--input-format, else jsonl for a *.jsonl / *.ndjson --input, else text."""
    if args.input_format != "auto":
        return args.input_format
    return "jsonl" if (args.input or "-").lower().endswith((".jsonl", ".ndjson")) else "text"


def output_format_of(args: argparse.Namespace) -> str:
    """--format, else the one --output's extension names, else jsonl (for stdout by any name, a pipe or a device
    too: the one format a stream takes)."""
    if args.format is not None:
        return args.format
    if args.output is not None:
        suffix = Path(args.output).suffix.lower().lstrip(".")
        if suffix in embedding.FORMATS:
            return suffix
        if suffix in ("json", "ndjson") or embedding.is_stream(args.output):
            return "jsonl"
        raise UserError(f"cannot tell the format of --output {args.output}: give --format or use .jsonl, .npy or "
                        ".parquet")
    return "jsonl"


def build_embedder(args: argparse.Namespace) -> tuple:
    """(embedder, rows per window): a local `fastbert.embedding.Embedder` or, with --ray, actors on a cluster."""
    options = dict(model_dir=args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                   pooling=args.pooling, normalize=args.normalize, max_length=args.max_length,
                   max_batch_tokens=args.max_batch_tokens, max_batch_size=args.batch_size)
    if args.ray:
        from fastbert.embedding.ray import RayClusterEmbedder

        embedder = RayClusterEmbedder(options, actors=args.ray_actors, address=args.ray_address,
                                      cpus_per_actor=args.ray_cpus, gpus_per_actor=args.ray_gpus)
        return embedder, args.window_rows or 16384
    return embedding.Embedder(**options), args.window_rows or 2048


def input_rows(args: argparse.Namespace) -> tuple:
    """(rows, byte counter, input size, stream to close): the TEXT arguments, or the rows of --input."""
    if args.texts:
        files = [t for t in args.texts if os.path.isfile(t)]
        if files:  # embedded as text, as asked: say so, since reading the file was likely meant
            sys.stderr.write(f"fastbert embed: note: TEXT {files[0]!r} names a file; it is embedded as text (to "
                             "embed the file's lines, give -i FILE)\n")
        rows = (embedding.text_row(i, i, t) for i, t in enumerate(args.texts, start=1))
        return rows, None, None, None
    counter, size, name = embedding.open_input(args.input or "-")
    field = args.field if args.field is not None else "text"
    rows = embedding.read_rows(counter, input_format_of(args), field, args.id_field, name)
    return rows, counter, size, counter.stream


def open_output(args: argparse.Namespace, embedder: Embedder | RayClusterEmbedder, output_format: str,
                window_rows: int) -> FileOutput | ShardedOutput:
    """The writer: shards in --output-dir (resumed with --resume), else one file (or stdout)."""
    string_ids = args.id_field is not None
    dtype = np.float16 if args.output_dtype == "float16" else np.float32
    if args.output_dir is None:
        return embedding.FileOutput(args.output, output_format, embedder.dimension, dtype, string_ids)
    source = os.path.abspath(args.input) if args.input not in (None, "-") else "-"  # resumable from any directory
    field = args.field if args.field is not None else "text"
    settings = {**embedder.settings(), "window_rows": window_rows, "input": source,
                "input_format": args.input_format, "field": field, "id_field": args.id_field}
    if args.id_field is not None:  # fastbert 0.1.0 wrote a null row for them: its runs resume with other rows
        settings["blank_jsonl_lines"] = "skipped"
    return embedding.ShardedOutput(args.output_dir, output_format, embedder.dimension, dtype, settings,
                                   resume=args.resume, string_ids=string_ids)


def write_summary(stats: EmbedStats, initial: EmbedStats | None, embedder: Embedder | RayClusterEmbedder,
                  output: FileOutput | ShardedOutput, elapsed: float) -> None:
    """The truncation warning and the run's summary line, on stderr."""
    if stats.truncated:
        limit = embedder.settings()["max_length"]
        were = "was" if stats.truncated == 1 else "were"
        sys.stderr.write(f"fastbert: warning: {plural(stats.truncated, 'text')} {were} longer than {limit} tokens "
                         f"and {were} truncated ({embedding.truncation_note(stats)}); --max-length sets the limit\n")
    if stats.invisible:
        sys.stderr.write(f"fastbert embed: note: {embedding.invisible_rows_note(stats)}\n")
    before = initial or embedding.EmbedStats()
    this_run = f" ({stats.rows - before.rows:,} this run, {before.rows:,} before)" if initial is not None else ""
    sys.stderr.write(f"fastbert embed: {stats.rows:,} rows{this_run} -> {output.describe()}: {stats.embedded:,} "
                     f"embedded, {stats.null_rows:,} null (blank), {stats.truncated:,} truncated; {stats.tokens:,} "
                     f"tokens; this run {elapsed:.1f} s ({per_second(stats.embedded - before.embedded, elapsed)} "
                     f"texts/s, {per_second(stats.tokens - before.tokens, elapsed)} tokens/s, model load included)\n")


def check_similarity_options(args: argparse.Namespace) -> None:
    """UserError for an option --similarity would ignore: it prints a table of its TEXTs, reads and writes no file."""
    ignored = (("--input", args.input), ("--input-format", args.input_format != "auto"),
               ("--field", args.field), ("--id-field", args.id_field), ("--output", args.output),
               ("--output-dir", args.output_dir), ("--format", args.format), ("--resume", args.resume),
               ("--output-dtype", args.output_dtype != "float32"), ("--window-rows", args.window_rows),
               ("--on-blank", args.on_blank != "null"))
    given = [option for option, value in ignored if value]
    if given:
        raise UserError(f"--similarity prints the similarity table of its TEXTs; it takes no {', '.join(given)}")
    if not args.texts:
        raise UserError("--similarity needs TEXT arguments")
    blank = next((i for i, t in enumerate(args.texts) if embedding.is_blank(t)), None)
    if blank is not None:
        text = args.texts[blank]
        why = f": {embedding.invisible_note(text)}" if text.strip() else ""
        raise UserError(f"--similarity: a TEXT is blank (TEXT {blank + 1}{why})")


def print_similarity(args: argparse.Namespace, embedder: Embedder | RayClusterEmbedder) -> int:
    """The cosine similarity matrix of the TEXT arguments, as a table on stdout."""
    texts = list(args.texts)  # checked by check_similarity_options: at least one, none blank
    kept_nothing = embedder.kept_nothing(texts)
    blank = next((i for i, why in enumerate(kept_nothing) if why is not None), None)
    if blank is not None:
        raise UserError(f"--similarity: a TEXT is blank (TEXT {blank + 1}: {kept_nothing[blank]})")
    vectors, _ = embedder.embed(texts)
    matrix = torch.from_numpy(vectors) @ torch.from_numpy(vectors).T
    labels = [f"[{i}] " + (t if len(t) <= 48 else t[:45] + "...") for i, t in enumerate(texts)]
    rows = [[label] + [f"{float(v):.3f}" for v in row] for label, row in zip(labels, matrix, strict=True)]
    print(report.format_table(["text"] + [f"[{i}]" for i in range(len(texts))], rows))
    return 0
