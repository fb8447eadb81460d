"""The accelerator run's report (``benchmarks/gpu.py``): ResNet images/s, ratios and MFU, the
MLP side by side under both flag settings, the budget; from the rows the workers measured.

Stdlib only at import.
"""

from __future__ import annotations

from benchmarks import run_report, runner
from benchmarks.gpu_plan import FLAG_SETTINGS, PEAK_FLOPS, RESNET_VARIANTS, Plan, flag_name, on_flag
from benchmarks.runner import fmt


def _find(rows: list[dict], variant: str, flag: str) -> dict | None:
  for r in rows:
    if r["variant"] == variant and r["flag"] == flag and r["status"] == "ok":
      return r
  return None


def images_per_s(row: dict, batch: int) -> float:
  return row["steps"] * batch / row["secs"]


def flops_per_step(rows: list[dict]) -> tuple[float | None, str]:
  """FLOPs of one train step: the step's jaxpr count (:func:`loopkit.core.flops.jaxpr_flops`,
  matrix products and convolutions) if a row has it, else the compiled per-step executable's
  cost analysis, else the lowered (unoptimised) HLO's.

  The jaxpr count comes first because XLA:GPU's cost analysis leaves out the convolutions it
  hands to cuDNN (custom calls): on the H200 it gave 105.8 GFLOP for a ResNet-50 step of batch
  256, against 7.23 TFLOP counted from its jaxpr (28.2 GFLOP per image, forward and backward).
  """
  for r in rows:
    if r.get("jaxpr_flops"):
      return r["jaxpr_flops"], "step's jaxpr (`loopkit.core.flops.jaxpr_flops`: matrix " \
          "products and convolutions; XLA:GPU's `cost_analysis()` leaves out cuDNN's convolutions)"
  for r in rows:
    if r["status"] == "ok" and r.get("compiled_flops"):
      return r["compiled_flops"], "compiled per-step executable's `cost_analysis()`"
  for r in rows:
    if r.get("lowered_flops"):
      return r["lowered_flops"], "lowered HLO (`jit(step).lower(...).cost_analysis()`; no " \
          "per-step row had the compiled count)"
  return None, "not measured"


def peak_flops(device_kind: str, override: float | None) -> float | None:
  if override:
    return override
  for name, peak in PEAK_FLOPS.items():
    if name in device_kind:
      return peak
  return None


def summarize_resnet(rows: list[dict], plan: Plan, peak: float | None) -> list[dict]:
  """One entry per (ResNet variant, flag) in table order, ratios from the measured rows.

  Ratios are to the per-step loop and to the limit of the *same* flag setting;
  MFU = FLOPs per step x steps/s / peak.
  """
  flops, _ = flops_per_step(rows)
  out = []
  for variant in RESNET_VARIANTS:
    for flag in FLAG_SETTINGS:
      r = next((x for x in rows if x["variant"] == variant and x["flag"] == flag), None)
      if r is None:
        continue
      e = {"variant": variant, "flag": flag, "status": r["status"], "row": r}
      if r["status"] == "ok":
        ips = images_per_s(r, plan.batch)
        e["images_per_s"] = ips
        if r.get("steady_steps_per_s"):
          e["steady_images_per_s"] = r["steady_steps_per_s"] * plan.batch
        base = _find(rows, "per-step", flag)
        lim = _find(rows, "limit", flag)
        e["vs_per_step"] = ips / images_per_s(base, plan.batch) if base else None
        e["vs_limit"] = ips / images_per_s(lim, plan.batch) if lim else None
        e["mfu"] = flops * ips / plan.batch / peak if (flops and peak) else None
        e["cpu_s_per_call"] = r["cpu_s"] / r["calls"]
      out.append(e)
  return out


def render_resnet(rows: list[dict], plan: Plan, peak: float | None) -> str:
  lines = [f"| system | {flag_name()} | steps (calls) | images/s | steady images/s | / per-step "
           "| / limit | MFU | host CPU s/call | dispatch s | device wait s | compile + warm-up s "
           "| executables | status |", "|" + "---|" * 14]
  for e in summarize_resnet(rows, plan, peak):
    r = e["row"]
    if e["status"] != "ok":
      lines.append(f"| {e['variant']} | {e['flag']} | | | | | | | | | | | | {e['status']} |")
      continue
    lines.append(
        f"| {r['system']} | {e['flag']} | {r['steps']} ({r['calls']}) | "
        f"{e['images_per_s']:,.1f} | {fmt(e.get('steady_images_per_s'), ',.1f')} | "
        f"{fmt(e['vs_per_step'], '.3f')} | {fmt(e['vs_limit'], '.3f')} | "
        + ("—" if e["mfu"] is None else f"{100 * e['mfu']:.1f}%") + " | "
        f"{e['cpu_s_per_call']:.4f} | {fmt(r.get('dispatch_s'), '.2f')} | "
        f"{fmt(r.get('device_wait_s'), '.2f')} | {r['warm_s']:.1f} | {r['executables']} | ok |")
  return "\n".join(lines)


def resnet_headlines(rows: list[dict], plan: Plan, peak: float | None) -> list[str]:
  """One line per flag setting with the figures the issue's closing note asks for."""
  by = {(e["variant"], e["flag"]): e for e in summarize_resnet(rows, plan, peak)
        if e["status"] == "ok"}
  out = []
  for flag in FLAG_SETTINGS:
    parts = []
    for v in ("K=26", "K=100"):
      e = by.get((v, flag))
      if e:
        parts.append(f"{v} {e['images_per_s']:,.0f} images/s = {fmt(e['vs_per_step'], '.2f')}x "
                     f"per-step, {fmt(e['vs_limit'], '.2f')}x the limit, MFU "
                     + ("—" if e["mfu"] is None else f"{100 * e['mfu']:.1f}%"))
    for v in ("per-step", "limit"):
      e = by.get((v, flag))
      if e:
        parts.append(f"{v} {e['images_per_s']:,.0f} images/s")
    if parts:
      out.append(f"- {flag_name()} {flag}: " + "; ".join(parts))
  return out


def mlp_rows(rows: list[dict], flag: str) -> tuple[list[dict], list[dict]]:
  r = _find(rows, "mlp", flag)
  if r is None:
    return [], []
  return r["mlp"]["rows"], r["mlp"]["mechanism"]


def render_mlp_summary(rows: list[dict]) -> str:
  """MLP steps/s and ratios, both flag settings side by side."""
  lines = ["| system | " + " | ".join(
      f"steps/s ({f}) | / limit ({f}) | / per-step jit + prefetch ({f}) | / fastest per-step "
      f"({f}) | host CPU µs/step ({f})" for f in FLAG_SETTINGS) + " |",
      "|---|" + "---|" * (5 * len(FLAG_SETTINGS))]
  names = []
  for flag in FLAG_SETTINGS:
    for r in mlp_rows(rows, flag)[0]:
      if r["system"] not in names:
        names.append(r["system"])
  for name in names:
    cols = [name]
    for flag in FLAG_SETTINGS:
      mrows = mlp_rows(rows, flag)[0]
      r = next((x for x in mrows if x["system"] == name), None)
      if r is None:
        cols += [""] * 5
        continue
      rate = runner.best_rate(r)
      lim = runner.find(mrows, "mlp", r["devices"], "limit (one scan)")
      flax = runner.find(mrows, "mlp", r["devices"], "per-step jit + prefetch")
      fastest = runner.fastest_per_step(mrows, "mlp", r["devices"])
      cols += [f"{rate:,.0f}", fmt(rate / runner.best_rate(lim) if lim else None, ".3f"),
               fmt(rate / runner.best_rate(flax) if flax else None, ".2f"),
               fmt(rate / runner.best_rate(fastest) if fastest else None, ".2f"),
               f"{min(r['cpu']) / r['steps'] * 1e6:.1f}"]
    lines.append("| " + " | ".join(cols) + " |")
  return "\n".join(lines)


def render_budget(rows: list[dict]) -> str:
  lines = [f"| {flag_name()} | variant | expected s | took s | status |", "|---|---|---|---|---|"]
  for r in rows:
    status = r["status"] if r["status"] == "ok" else r["status"].replace("|", "/")
    lines.append(f"| {r['flag']} | {r['variant']} | {r.get('expected_s', '—')} | "
                 f"{r.get('took_s', '—')} | {status} |")
  return "\n".join(lines)


def render_report(res: dict, plan: Plan, meta: dict) -> str:
  rows = res["rows"]
  m = next((x for x in res["metas"].values() if x), {})
  kind = m.get("device_kind", "unknown")
  peak = peak_flops(kind, meta.get("peak_flops"))
  flops, flops_src = flops_per_step(rows)
  ok = sum(r["status"] == "ok" for r in rows)
  parts = [
      "# loopkit on an accelerator: ResNet-50 and the dispatch-bound MLP, side by side",
      "",
      "Generated by `benchmarks/gpu.py` in one run; `benchmarks/README.md` says what each "
      "system is. Every variant ran with and without "
      f"`XLA_FLAGS={on_flag()}` (*on* / *off*), each flag setting in its "
      "own worker process.",
      "",
      f"- date: {meta['date']}",
      f"- command: `{meta['command']}`",
      f"- device: {m.get('device_count', '?')} x {kind} (platform {m.get('platform', '?')})"
      + (f"; nvidia-smi: {meta['nvidia_smi']}" if meta.get("nvidia_smi") else ""),
      f"- host: {meta['machine']['nproc']} CPUs ({meta['machine']['cpu']}), "
      f"{meta['machine']['ram']} RAM, Python {meta['machine']['python']}",
      "- packages: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
      f"- XLA_FLAGS seen by the workers: on: `{res['metas'].get('on', {}).get('xla_flags', '—')}`"
      f"; off: `{res['metas'].get('off', {}).get('xla_flags', '—')}`",
      f"- plan `{plan.name}`: {plan.model_name}, {plan.image_size}x{plan.image_size}, bfloat16, "
      f"global batch {plan.batch}, {plan.num_classes} classes; each variant: a warm-up run of "
      f"{plan.warm_steps} steps (its compile), then {plan.timed_steps} timed steps rounded up to "
      f"whole calls (at least {plan.min_calls} calls for K > 1); host pool of {plan.pool} "
      f"distinct uint8 batches; MLP S = {plan.mlp_steps}, best of {plan.mlp_repeats} rounds",
      f"- budget {plan.budget_s:.0f} s; wall time {res['wall_s']:.0f} s; {ok} of {len(rows)} "
      "variants measured" + ("" if ok == len(rows) else
                             " (the rest were skipped or failed: see *Budget*)"),
  ]
  if meta.get("commit"):
    parts.insert(parts.index(f"- command: `{meta['command']}`") + 1,
                 f"- loopkit commit: {meta['commit']}")
  parts += [f"- note: {n}" for n in res.get("notes", [])]
  if m.get("platform") not in (None, "gpu", "cuda", "rocm", "tpu"):
    parts += ["", f"**Not an accelerator run**: the workers ran on `{m.get('platform')}` "
              "devices; the figures check the code paths, not speed."]
  parts += [
      "",
      f"## {plan.model_name}, {plan.image_size}x{plan.image_size}, bf16, batch {plan.batch}",
      "",
      f"FLOPs per train step: {fmt(None if flops is None else flops / 1e9, ',.4g')} GFLOP, "
      f"from the {flops_src}; MFU against "
      + (f"{peak / 1e12:.0f} TFLOP/s peak dense bf16 (NVIDIA's datasheet: 1,979 TFLOPS "
         "with sparsity)" if peak else "no peak (unknown device kind; pass --peak-tflops)")
      + ". *images/s* is end to end over the timed run (loopkit: `TrainLoop.run` from the host "
      "source, its first chunk's stacking and transfer included); *steady* runs from the run's "
      "first boundary to its last but one (at least 3 calls). Ratios are to the same flag "
      "setting's per-step loop and limit. *host CPU s/call*: `time.process_time` (all "
      "threads) over the timed run / calls. *dispatch* and *device wait*: the loop's ledger "
      "buckets over the timed run.",
      "",
      render_resnet(rows, plan, peak),
      "",
  ]
  parts += resnet_headlines(rows, plan, peak) + [""]
  parts += ["## Dispatch-bound MLP (`benchmarks/run.py`'s workload, 1 device)", "",
            render_mlp_summary(rows), ""]
  for flag in FLAG_SETTINGS:
    mrows, mech = mlp_rows(rows, flag)
    if mrows:
      parts += [f"### MLP, {flag_name()} {flag}: every system", "",
                run_report.render_table(mrows), ""]
    if mech:
      parts += [f"Tail/event mechanism, {flag_name()} {flag} (loopkit's `fori_loop` with a "
                "traced trip count against an unmasked `lax.scan` of K steps, chunk on device):",
                "", run_report.render_mechanism(mech), ""]
  parts += ["## Budget", "",
            "Expected seconds are the worker's estimate when it started the variant (compile + "
            "warm-up + timed steps, refined by what it had measured); a variant that would not "
            "fit its flag setting's share of the budget is skipped, one past its timeout is "
            "killed.", "", render_budget(rows), ""]
  return "\n".join(parts)
