"""``parity diff`` as one call: ``run(job)`` of a ``parity.diff.job.DiffJob`` opens the checkpoint,
loads the engine and the float64 reference, and diffs one prompt (printing its table, writing its
report and plot), a corpus (``corpus_driver``) or writes a token plan (``--plan``). The exit
status: 0 when no step diverged and every number is within its bound, 1 when a step diverged or
numbers are past their bound; unusable input raises ``InputError`` (one line). Documented in
docs/cli.md.
"""
from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from parity.errors import InputError, write_output

from . import corpus_driver, reference_device, setup
from .corpus_driver import dump_folder
from .engines import DumpEngine, EngineError
from .engines.plan import make_plan, write_plan
from .job import Decode, DiffJob, Loaded
from .plot import write_plot
from .render import print_result
from .report import build_report, environment, write_json
from .runner import diff_prompt
from .setup import checkpoint_errors, one_line

DEFAULT_STEPS = {"cuda": 128, "cpu": 16}  # the Triton interpreter takes ~1-3 s per decode step


def settled(job: DiffJob, device: str) -> DiffJob:
    """``job`` with the defaults of what it left open: the steps of ``device``, forced mode, bfloat16."""
    return replace(job, steps=job.steps or DEFAULT_STEPS[device], mode=job.mode or "forced",
                   dtype=job.dtype or "bfloat16")


def run(job: DiffJob) -> int:
    """The ``parity diff`` of ``job`` (module docstring); its exit status."""
    variants, backends, device = job.variants or {}, job.backends or {}, job.device
    ckpt = setup.open_checkpoint(job.checkpoint, synthetic=job.synthetic, seed=job.seed)
    err = Console(stderr=True, highlight=False)
    if not err.is_terminal:
        err = Console(stderr=True, highlight=False, width=140)
    if job.plan:
        return _write_plan(job, ckpt, variants, device, err)
    opt_ckpt = None
    if job.optimized_from:
        opt_ckpt = setup.open_checkpoint(job.optimized_from)
        setup.same_model(ckpt, opt_ckpt)
    folder = dump_folder(job.engine)  # a folder of dumps: a corpus, one prompt each
    if job.prompts:
        prompts = corpus_driver.read(job.prompts, ckpt)
    elif folder is not None:
        prompts, shared = corpus_driver.read_dump_folder(job, folder)
        job = replace(job, **shared)   # the steps, mode and dtype of the dumps
    else:
        prompts = None

    def load(spec):
        return setup.load_engine(spec, opt_ckpt or ckpt, dtype=job.dtype, device=device, variants=variants,
                                 backends=backends, reference_source=ckpt.source, free=job.free_memory,
                                 reference_device=job.reference_device)

    engine = load(job.engine if folder is None else f"dump:{folder / prompts[0].source}")
    if prompts is not None:
        job = settled(job, device)
        job, loaded = prepare(job, ckpt, opt_ckpt, engine, err, corpus_driver.describe(job, prompts))
        return corpus_driver.run(job, loaded, prompts,
                                 engine_for=None if folder is None else lambda p: load(f"dump:{folder / p.source}"))
    job, ids, text, tok, tokens = _run_shape(job, ckpt, engine, device)
    job, loaded = prepare(job, ckpt, opt_ckpt, engine, err, f"prompt: {len(ids)} tokens")
    return _diff(job, loaded, ids, text, tok, tokens)


def _run_shape(job, ckpt, engine, device):
    """(the job with its steps, mode and dtype settled, prompt ids, text, tokenizer, tokens both
    paths consume or None): a dump fixes the prompt, the steps, the mode and, in free mode, the
    tokens; the options may only agree with it."""
    dump = engine.engine if isinstance(engine.engine, DumpEngine) else None
    if dump is None:
        ids, text, tok = setup.prompt_ids(ckpt, text=job.prompt, ids=job.prompt_ids)
        return settled(job, device), ids, text, tok, None
    ids, text, tok = dump.prompt_ids, None, None
    if job.prompt is not None or job.prompt_ids is not None:
        given, text, tok = setup.prompt_ids(ckpt, text=job.prompt, ids=job.prompt_ids)
        if given != ids:
            raise InputError(f"{dump.path}: the dump ran another prompt ({len(ids)} tokens) than the one given "
                             f"({len(given)} tokens); leave out --prompt/--prompt-ids")
    if job.steps is not None and job.steps > dump.steps:
        raise InputError(f"--steps {job.steps}: {dump.path} holds {dump.steps} steps")
    if job.mode is not None and job.mode != dump.mode:
        raise InputError(f"--mode {job.mode}: {dump.path} is a {dump.mode}-mode dump")
    job = replace(job, steps=job.steps or dump.steps, mode=dump.mode, dtype=dump.dtype)
    return job, ids, text, tok, (dump.tokens if dump.mode == "free" else None)


def _describe_engine(job, engine, env, rounding, backends) -> str:
    device = env["device"]
    if job.engine == "optimized":
        info = env["backend_info"]
        how = "CUDA " + str(info.get("cuda")) if device == "cuda" else (
            "CPU, Triton interpreter" + (", faithful bf16 dot installed" if info["faithful_bf16_dot"] else "")
            if info["triton_interpreter"] else "CPU")
        return (f"optimized path: {job.dtype} on {how}"
                + (f" (rounds to {job.dtype} {rounding})" if rounding != "nearest" else "")
                + (f"; backends {backends}" if backends else ""))
    inner = engine.engine
    folder = dump_folder(job.engine)
    if folder is not None:
        return f"engine: the dumps in {folder} ({inner.dtype}, {inner.mode} mode), each on its own prompt"
    if job.engine.startswith("dump:"):
        return (f"engine: dump {inner.path} ({inner.engine_name or 'unnamed engine'}, {inner.dtype}, "
                f"{inner.mode} mode, {inner.steps} steps, {'traces' if inner.traced else 'no traces'})")
    return f"engine: {job.engine} ({type(inner).__name__}), {job.dtype} on {device}"


def prepare(job: DiffJob, ckpt, opt_ckpt, engine, err, what: str) -> tuple[DiffJob, Loaded]:
    """(the job with ``reference_device`` resolved, what it loaded: the float64 reference beside
    the engine, the environment, the platform's rounding); the header on stderr (``what``: the
    prompt or corpus line)."""
    variants, backends, device = job.variants or {}, job.backends or {}, job.device
    # on one GPU the reference reads the optimized model's resident weights (same checkpoint only)
    share = engine.engine if job.engine == "optimized" and opt_ckpt is None else None
    ref = reference_device.load(ckpt, variants, job.reference_device, share=share)
    job = replace(job, reference_device=reference_device.where(ref))  # auto, resolved: the advice on memory errors
    env = environment(device=device, dtype=job.dtype)
    env["reference"] = reference_device.info(ref)
    rounding = setup.platform_rounding(job.dtype, device) if job.engine == "optimized" else "nearest"
    env["rounding"] = rounding
    err.print(f"reference: {ckpt.info['describe']}", markup=False)
    if opt_ckpt is not None:
        err.print(f"{'optimized' if job.engine == 'optimized' else 'engine'}: {opt_ckpt.info['describe']}",
                  markup=False)
    err.print(_describe_engine(job, engine, env, rounding, backends), markup=False)
    err.print(f"float64 reference: {ref.executor.describe()}"
              + (", reading the optimized model's weights" if ref.shares_weights else ""), markup=False)
    err.print(f"variants: {variants_of(ref)}; {what}; mode {job.mode}; {job.steps} steps", markup=False)
    return job, Loaded(ckpt, opt_ckpt, engine, ref, env, rounding, err)


def _diff(job: DiffJob, loaded: Loaded, ids, text, tok, tokens) -> int:
    """One prompt decoded and judged: its table on stdout, its report and plot written."""
    ckpt, opt_ckpt, engine, ref, env, rounding, err = (loaded.ckpt, loaded.opt_ckpt, loaded.engine, loaded.ref,
                                                       loaded.env, loaded.rounding, loaded.err)
    device, config = job.device, ckpt.source.config
    out = Console(highlight=False)
    if not out.is_terminal:  # a pipe or a file: room for every column
        out = Console(highlight=False, width=140)

    lm_head = setup.lm_head_span(ckpt, device)
    with reference_device.memory_errors(job.reference_device, device):
        result = _decode(ref, engine, ids, config, job, err, rounding, tokens, lm_head)
    decode = (lambda t: tok.decode([t])) if tok is not None else None
    print_result(result, out, decode=decode)

    if job.json or job.plot:
        prompt = {"text": text, "ids": ids}
        report = build_report(result, checkpoint=ckpt.info, config=config,
                              variants=loaded.variants, env=env, prompt=prompt, backends=job.backends or {},
                              optimized_checkpoint=opt_ckpt.info if opt_ckpt else None,
                              engine=job.engine)
        if job.json:
            write_output(job.json, lambda: write_json(job.json, report))
        if job.plot:
            moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
            write_output(job.plot, lambda: write_plot(result, job.plot, moe_layers=moe))
    return 1 if result.verdict in ("diverged", "past-bound") else 0


def _write_plan(job, ckpt, variants, device, err) -> int:
    """``--plan PATH``: the reference alone, greedy; the plan an engine teacher-forces."""
    if job.engine != "optimized" or job.optimized_from or job.backends:
        raise InputError("--plan runs the reference alone: leave out --engine, --optimized-from and --backend")
    ids, _, _ = setup.prompt_ids(ckpt, text=job.prompt, ids=job.prompt_ids)
    steps = job.steps or DEFAULT_STEPS[device]
    ref = reference_device.load(ckpt, variants, job.reference_device)
    job = replace(job, reference_device=reference_device.where(ref))
    err.print(f"reference: {ckpt.info['describe']}; plan: {len(ids)} prompt tokens, {steps} steps", markup=False)
    try:
        with reference_device.memory_errors(job.reference_device, device):
            plan = make_plan(ref, ids, steps=steps, config=ckpt.source.config, checkpoint=ckpt.info)
    except setup.checkpoint_errors() as exc:
        raise InputError(setup.one_line(exc)) from None
    write_output(job.plan, lambda: write_plan(job.plan, plan))
    print(f"wrote {job.plan}: prefill the {len(ids)} prompt ids, then decode tokens[1:] ({steps - 1} tokens); "
          f"write the logits of all {steps} steps to a dump (docs/dump-format.md)")
    return 0


def variants_of(model) -> dict:
    """The semantic variants ``model`` ran (the report's ``variants``)."""
    return dict(getattr(model, "variants", {}) or {})


def _decode(ref, opt, ids, config, job, err, rounding, tokens, lm_head):
    show = job.progress and err.is_terminal
    with Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not show) as progress:
        task = progress.add_task("decode", total=job.steps, last="")

        def on_step(rec):
            progress.update(task, advance=1, last=f"step {rec.step}: {rec.verdict}")

        try:
            decode = Decode(config, job.steps, mode=job.mode, dtype=job.dtype, rounding=rounding, tokens=tokens,
                            lm_head=lm_head)
            return diff_prompt(ref, opt, ids, decode, on_step=on_step)
        except checkpoint_errors() as exc:  # the reference reads (and validates) weights as it goes
            raise InputError(one_line(exc)) from None
        except EngineError as exc:  # an engine that broke the protocol mid-run: nothing is written
            raise InputError(one_line(exc)) from None

