"""Why does the step KL on the batch exceed the KL budget? Every row of every update, measured.

Runs a config (default the quickstart) through the ``logra`` CLI with ``RowRecordingGRPOModule``,
which around each optimizer step keeps the full-vocabulary logits of every trained position
of the update's rows and records, per row: the exact KL(before || after) summed over its
trained positions, k3 at the tokens that built the update (what ``policy/step_kl`` averaged
until issue 41), k3 at one token per position freshly sampled from the pre-step policy, the
row's length, advantage and whether LoGRA's probe scored it; and per update, the step's
report (budget, predicted KL after scaling, alpha). ``--render`` turns the records into the
table of ``benchmarks/results/step_kl_rows.md``: the batch's exact step KL over the budget,
and what each estimator and each choice of probe rows would have reported.

    python -m benchmarks.step_kl_rows                   # the quickstart, 12 steps: ~6 min on 2 cores
    python -m benchmarks.step_kl_rows --config configs/quickstart_code.yaml --name code
    python -m benchmarks.step_kl_rows --name arithmetic2 -- --data.init_args.train=arithmetic:2 ...
    python -m benchmarks.step_kl_rows --render benchmarks/results/step_kl_rows.json
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.probe_batch import share_weighted_rows, stratified_rows
from lightning_logra.modules import GRPOModule
from lightning_logra.rl.kl_estimators import k3

from .cli_runs import fresh_work, mlflow_environment, run_logra
from .harness import argument_parser, code_line, code_version, command_line, load_json, machine_info, machine_line, save_json, write_outputs

RECORDS = "LOGRA_STEP_KL_ROWS"  # the JSON-lines file the recording module appends to
BAND = (0.67, 1.5)  # step KL / budget (issue 41's target)
COUNTS = (2, 4, 8, 16)  # probe rows the render simulates
DRAWS = 200


class RowRecordingGRPOModule(GRPOModule):
    """``GRPOModule`` that measures, per row, how far each of its optimizer steps moved the policy."""

    def _update(self, batch, rows, passes, phases):
        before = _trained_logits(self.policy, batch, rows, self._micro_batching.temperature)
        trained = super()._update(batch, rows, passes, phases)
        if trained is None:
            return None
        after = _trained_logits(self.policy, batch, rows, self._micro_batching.temperature)
        generator = torch.Generator().manual_seed(self.global_step)
        mask = batch.mask[rows]
        count = mask.shape[0]
        probe_order = torch.arange(count).view(-1, self.rollout_config.num_generations).T.reshape(-1).tolist()
        report = self.trainer.strategy.last_report
        records = []
        for row, (log_p, log_q) in enumerate(zip(before, after)):
            exact = (log_p.exp() * (log_p - log_q)).sum(-1)
            fresh = torch.multinomial(log_p.exp(), 1, generator=generator).squeeze(-1)
            picked = torch.arange(fresh.numel())
            sampled_tokens = batch.rollouts.input_ids[rows][row, 1:][mask[row]]
            records.append({
                "positions": int(mask[row].sum()),
                "exact_sum": float(exact.sum()),
                "exact_max": float(exact.max()),
                "sampled_logprob_min": float(log_p[picked, sampled_tokens].min()),
                "entropy_mean": float(-(log_p.exp() * log_p).sum(-1).mean()),
                "k3_trained_sum": float(k3((log_q - log_p)[picked, sampled_tokens]).sum()),
                "k3_fresh_sum": float(k3((log_q - log_p)[picked, fresh]).sum()),
                "advantage": float(batch.advantages[rows][row]),
                "probe_rank": probe_order.index(row),
            })
        entry = {"step": self.global_step, "rows": records}
        if report is not None:
            entry.update(budget=report.budget, predicted=report.predicted_kl, predicted_scaled=report.predicted_kl_scaled,
                         alpha=report.alpha, measured_probe=report.measured_kl)
        with open(os.environ[RECORDS], "a") as stream:
            stream.write(json.dumps(entry) + "\n")
        return trained


@torch.no_grad()
def _trained_logits(policy, batch, rows, temperature: float) -> list[torch.Tensor]:
    """Per row, the float64 log-softmax at the positions that generated its trained tokens."""
    was_training = policy.training
    policy.eval()
    out = []
    try:
        for row in range(rows.start, rows.stop):
            keep = batch.rollouts.attention_mask[row].bool()
            ids = batch.rollouts.input_ids[row : row + 1, keep]
            logits = policy(input_ids=ids).logits[0, :-1].double() / temperature
            # The trained mask is over the padded row's positions 0..T-2; the unpadded logits[:-1]
            # are those of the positions whose token and next token are both real.
            trained = batch.mask[row][keep[:-1] & keep[1:]]
            out.append(torch.log_softmax(logits[trained], dim=-1))
    finally:
        policy.train(was_training)
    return out


def measure(config: str, name: str, steps: int | None, overrides: list[str]) -> dict:
    work = fresh_work(f"step_kl_rows_{name}")
    records = work / "rows.jsonl"
    environment = dict(mlflow_environment(work), **{RECORDS: str(records)})
    arguments = ["fit", "-c", config, "--model.class_path=benchmarks.step_kl_rows.RowRecordingGRPOModule",
                 "--trainer.limit_val_batches=0", "--model.init_args.logging.completions_every=0",
                 f"--trainer.default_root_dir={work}", "--trainer.logger.init_args.experiment_name=step_kl_rows",
                 f"--trainer.logger.init_args.run_name={name}"]
    if steps is not None:
        arguments.append(f"--trainer.max_steps={steps}")
    arguments += overrides
    print(f"{name}: {config}", flush=True)
    seconds = run_logra(arguments, environment, work / "run.log")
    probe = next((value.split("=", 1)[1] for value in overrides if ".kl_probe=" in value), LoGRAConfig().kl_probe)
    return {"config": config, "overrides": overrides, "seconds": seconds, "kl_probe": probe,
            "updates": [json.loads(line) for line in records.read_text().splitlines()]}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / max(sum(r["positions"] for r in rows), 1)


def summarise(update: dict) -> dict:
    """One update's step KL on the batch and on row subsets (position-weighted means)."""
    rows = [r for r in update["rows"] if r["positions"]]
    by_probe = sorted(rows, key=lambda r: r["probe_rank"])
    summary = {"exact": _mean(rows, "exact_sum"), "k3_trained": _mean(rows, "k3_trained_sum"),
               "k3_fresh": _mean(rows, "k3_fresh_sum"), "budget": update.get("budget"),
               "predicted_scaled": update.get("predicted_scaled")}
    for count in (2, 4, 8):
        summary[f"exact_probe{count}"] = _mean(by_probe[:count], "exact_sum")
    per_row = sorted(r["exact_sum"] / r["positions"] for r in rows)
    summary["row_median_over_mean"] = statistics.median(per_row) / summary["exact"] if summary["exact"] else float("nan")
    return summary


RULES = {"stratified": stratified_rows, "weighted": share_weighted_rows}  # kl_probe -> its rows


def drawn_probe_ratios(update: dict, count: int, rule: str = "stratified", draws: int = DRAWS) -> list[float]:
    """The batch's exact step KL per position over what a probe of ``count`` rows drawn by
    ``kl_probe: rule`` would have estimated it at (the weighted mean over its rows, as the
    probe computes it), for ``draws`` seeded draws: with the probe's prediction equal to the
    exact KL of its rows (it agrees within a few percent), this is step KL / budget had that
    probe scaled the step."""
    rows = [r for r in update["rows"] if r["positions"]]
    positions = torch.tensor([float(r["positions"]) for r in rows])
    keys = torch.tensor([r["advantage"] for r in rows])
    mean = sum(r["exact_sum"] for r in rows) / sum(r["positions"] for r in rows)
    ratios = []
    for seed in range(draws):
        chosen, weights = RULES[rule](positions, [r["positions"] for r in rows], keys, count,
                                      torch.Generator().manual_seed(seed))
        estimate = (sum(w * rows[c]["exact_sum"] for c, w in zip(chosen, weights))
                    / sum(w * rows[c]["positions"] for c, w in zip(chosen, weights)))
        ratios.append(mean / estimate)
    return ratios


def render(result: dict) -> str:
    lines = ["# The step KL on the batch, row by row", "",
             "Per update: the exact KL(before || after) over every trained position of the batch, against the budget "
             "and LoGRA's scaled prediction on the rows its probe scored (the probe the run trained with, named under "
             "each table); "
             "what k3 at the trained tokens (`policy/step_kl` before issue 41) and k3 at one freshly sampled token "
             "per position report; the exact KL on the first 2, 4 and 8 probe-ordered rows (one per prompt first); "
             "the median row's KL over the batch's.", ""]
    for name, run in result["runs"].items():
        updates = [u for u in run["updates"] if u.get("budget") and summarise(u)["exact"] > 0]
        lines += [f"## {name} (`{run['config']}`)", "",
                  "| update | budget | predicted (scaled) | exact, batch | exact / budget | k3 trained / exact | "
                  "k3 fresh / exact | exact on 2 / 4 / 8 probe rows | row median / mean |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for update in updates:
            s = summarise(update)
            lines.append(
                f"| {update['step']} | {s['budget']:.2e} | {s['predicted_scaled']:.2e} | {s['exact']:.2e} | "
                f"{s['exact'] / s['budget']:.2f} | {s['k3_trained'] / s['exact']:.2f} | {s['k3_fresh'] / s['exact']:.2f} | "
                f"{s['exact_probe2']:.1e} / {s['exact_probe4']:.1e} / {s['exact_probe8']:.1e} | "
                f"{s['row_median_over_mean']:.2f} |")
        inside = sum(BAND[0] <= summarise(u)["exact"] / summarise(u)["budget"] <= BAND[1] for u in updates)
        lines += ["", f"Trained with `kl_probe: {run.get('kl_probe', 'reference')}`, {inside} of {len(updates)} updates "
                      f"moved the batch within [{BAND[0]}, {BAND[1]}] x the budget. Had a probe of k rows drawn by "
                      f"`stratified` (strata of equal tokens) or `weighted` (of equal expected KL) scaled these steps "
                      f"({DRAWS} draws each):", "",
                  "| k rows | stratified: steps within the band | median step KL / budget | 5th-95th percentile | "
                  "weighted: steps within the band | median | 5th-95th percentile |", "|---:|---:|---:|---|---:|---:|---|"]
        for count in COUNTS:
            cells = []
            for rule in RULES:
                ratios = sorted(r for u in updates for r in drawn_probe_ratios(u, count, rule))
                share = sum(BAND[0] <= r <= BAND[1] for r in ratios) / len(ratios)
                cells.append(f"{100 * share:.0f}% | {statistics.median(ratios):.2f} | "
                             f"{ratios[len(ratios) // 20]:.2f}-{ratios[-(len(ratios) // 20)]:.2f}")
            lines.append(f"| {count} | {' | '.join(cells)} |")
        lines += ["", f"{machine_line(run['machine'])}; command: `{run['command']}`. {code_line(run['code'])}"
                      f"{run.get('note', '')}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--name", default="quickstart")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="further `logra fit` arguments, e.g. --data.init_args.train=...")
    args = parser.parse_args()
    stem = args.out / "step_kl_rows"
    if args.render:
        write_outputs(stem, load_json(args.render), render, None)
        return
    path = stem.with_suffix(".json")
    result = load_json(path) if path.exists() else {"runs": {}}
    result["runs"][args.name] = measure(args.config, args.name, args.steps, args.overrides)
    result["runs"][args.name].update(command=command_line("step_kl_rows"), machine=machine_info(), code=code_version())
    save_json(path, result)
    write_outputs(stem, result, render, None)


if __name__ == "__main__":
    main()
