"""Mutation check: do the tests catch the bugs they claim to?

    python tests/mutation.py                 # every mutant, then a table; exit 1 if any survives
    python tests/mutation.py --list          # the mutants and the tests each one runs
    python tests/mutation.py --only top_ignores_normalize,balance_sign
    python tests/mutation.py --no-baseline   # skip the check that the copy passes unmutated

Copies the package (moetrain/, with conf/, recipes/ and csrc/ where the installed package finds
them), tests/ and pyproject.toml into a temporary directory, then plants each mutant of MUTANTS
below, one at a time: a one-line bug in one file. For each it runs only the test files that own
that code (with -x: the first failure kills the mutant) with the copy first on PYTHONPATH, so
subprocesses (the `moetrain` console script) run the mutant too. A mutant the tests pass is a
survivor: a bug they would let through. Not part of the default pytest run (about 20 minutes on
two cores); run it after changing tests or the code they cover.

Each mutant names its exact original text: if the code changed and the text is gone, the mutant
is reported as stale (fix its text), never silently skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    before: str  # must occur exactly once in the file
    after: str
    tests: tuple[str, ...]  # test files (relative to the repository root) that must catch it
    why: str


LAYER_TESTS = ("tests/moe/test_moe_layer.py",)
LOSS_TESTS = ("tests/moe/test_losses.py",)
STEP_TESTS = ("tests/train/test_train_step_reference.py",)
TRAIN_TESTS = ("tests/train/test_train.py",)
QUANT_TESTS = ("tests/quant/test_quant_layer.py",)
PRETRAINED_TESTS = ("tests/models/test_pretrained.py",)

MUTANTS = [
    # ---- gates (the issue's: normalize ignored, jitter in eval, cosine directions, scaling factor)
    Mutant("top_ignores_normalize", "moetrain/moe/top_gate.py",
           "return softmax_topk(logits_TE, top_k, self.normalize)", "return softmax_topk(logits_TE, top_k, False)",
           LAYER_TESTS, "the top gate never renormalises its k weights"),
    Mutant("jitter_in_eval", "moetrain/moe/top_gate.py",
           "if self.training and self.jitter_eps > 0:", "if self.jitter_eps > 0:",
           LAYER_TESTS, "Switch jitter also in eval mode"),
    Mutant("cosine_unnormalised_directions", "moetrain/moe/cosine_gate.py",
           "F.normalize(self.expert_dirs_EP.to(x_TD.dtype), dim=-1)", "self.expert_dirs_EP.to(x_TD.dtype)",
           LAYER_TESTS, "the cosine gate does not normalise the expert directions"),
    Mutant("sigmoid_drops_scaling_factor", "moetrain/moe/sigmoid_gate.py",
           "weight_TK = weight_TK * self.routed_scaling_factor", "weight_TK = weight_TK * 1.0",
           LAYER_TESTS, "the sigmoid gate drops routed_scaling_factor"),
    Mutant("sigmoid_bias_weighs", "moetrain/moe/sigmoid_gate.py",
           "weight_TK = scores_TE.gather(1, idx_TK)", "weight_TK = choice_TE.gather(1, idx_TK)",
           ("tests/moe/test_gate_references.py",), "the selection bias leaks into the combine weights"),
    Mutant("sigmoid_group_score_top1", "moetrain/moe/sigmoid_gate.py",
           "topk(min(2, grouped_TGX.size(-1)), dim=-1)", "topk(min(1, grouped_TGX.size(-1)), dim=-1)",
           ("tests/moe/test_gate_references.py",), "groups scored by their best expert instead of their two best"),
    Mutant("sigmoid_bias_update_sign", "moetrain/moe/sigmoid_gate.py",
           "torch.sign(self.pending_load.mean() - self.pending_load)",
           "torch.sign(self.pending_load - self.pending_load.mean())",
           LAYER_TESTS, "the load-balancing bias moves toward imbalance"),
    Mutant("cosine_scale_cap", "moetrain/moe/cosine_gate.py", "_MAX_SCALE = 100.0", "_MAX_SCALE = 1000.0",
           ("tests/moe/test_gate_references.py",), "the cosine gate's inverse temperature capped at 1000, not 100"),
    Mutant("softmax_renormalises_by_max", "moetrain/moe/gates.py",
           "weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True)",
           "weight_TK = weight_TK / weight_TK.amax(-1, keepdim=True)",
           ("tests/moe/test_gate_references.py",), "renormalisation divides by the largest weight"),
    # ---- routing and combine
    Mutant("capacity_one_row_more", "moetrain/moe/routing.py",
           "return top_k * max(per_choice, 1)", "return top_k * max(per_choice, 1) + 1",
           LAYER_TESTS, "each expert takes one row more than its capacity"),
    Mutant("batch_priority_ascending", "moetrain/moe/routing.py",
           "order_T = torch.argsort(priority_T, descending=True, stable=True)",
           "order_T = torch.argsort(priority_T, descending=False, stable=True)",
           LAYER_TESTS, "batch-prioritized routing keeps the least confident tokens"),
    Mutant("route_reference_capacity_off_by_one", "moetrain/ops/reference.py",
           "dest_N = torch.where(slot_N < cap,", "dest_N = torch.where(slot_N <= cap,",
           LAYER_TESTS, "the pure-torch routing keeps one choice past capacity"),
    Mutant("combine_ignores_drops", "moetrain/ops/reference.py",
           "scale_TK = valid_TK.to(opmath_dtype(buf_RD.dtype))",
           "scale_TK = torch.ones_like(valid_TK, dtype=opmath_dtype(buf_RD.dtype))",
           LAYER_TESTS, "the torch combine adds row 0 for dropped choices"),
    Mutant("packed_bias_wrong_row", "moetrain/ops/grouped.py",
           "expert_R = torch.searchsorted(ends_E, rows_R, right=True, out_int32=True)",
           "expert_R = torch.searchsorted(ends_E, rows_R, right=False, out_int32=True)",
           LAYER_TESTS, "the packed layout adds an expert's bias to the next expert's first row"),
    Mutant("padded_bias_rolled", "moetrain/ops/grouped.py",
           "return (y_RO.view(num_experts, capacity, out_dim) + b_EO.unsqueeze(1)).view_as(y_RO)",
           "return (y_RO.view(num_experts, capacity, out_dim) + b_EO.roll(1, 0).unsqueeze(1)).view_as(y_RO)",
           LAYER_TESTS, "the padded layout adds the neighbouring expert's bias"),
    Mutant("layer_balance_on_kept", "moetrain/moe/layer.py",
           "balance = losses.balance_loss(routed.probs_TE, plan.load_E, routed.topk_idx_TK.numel())",
           "balance = losses.balance_loss(routed.probs_TE, plan.counts_E, routed.topk_idx_TK.numel())",
           LAYER_TESTS, "the balance loss counts only kept choices"),
    Mutant("layer_ignores_balance_weight", "moetrain/moe/layer.py",
           "aux_loss = balance if self.balance_loss_weight == 1.0 else self.balance_loss_weight * balance",
           "aux_loss = balance",
           LOSS_TESTS, "balance_loss_weight ignored"),
    # ---- losses (the issue's: balance loss sign)
    Mutant("balance_sign", "moetrain/moe/losses.py",
           "return torch.dot(counts_E.to(probs_TE.dtype), mean_probs_E)",
           "return -torch.dot(counts_E.to(probs_TE.dtype), mean_probs_E)",
           LOSS_TESTS, "the balance loss with its sign flipped"),
    Mutant("z_loss_abs", "moetrain/moe/losses.py",
           "torch.logsumexp(logits_TE, dim=-1).square()", "torch.logsumexp(logits_TE, dim=-1).abs()",
           LOSS_TESTS, "the z-loss without its square"),
    # ---- optimizer
    Mutant("decay_expert_biases", "moetrain/train/optim.py",
           "return parameter.ndim >= 3 or (parameter.ndim == 2 and not is_expert_param(parameter))",
           "return parameter.ndim >= 2",
           STEP_TESTS, "weight decay also shrinks the experts' stacked biases"),
    Mutant("warmup_start", "moetrain/train/optim.py",
           "return cfg.lr * (step + 1) / (warmup_steps + 1)", "return cfg.lr * (step + 1) / warmup_steps",
           STEP_TESTS, "warm-up starts at lr / warmup_steps"),
    Mutant("betas_swapped", "moetrain/train/optim.py",
           "betas = tuple(cfg.betas)", "betas = tuple(reversed(cfg.betas))",
           STEP_TESTS, "AdamW gets its betas in the wrong order"),
    # ---- trainer (the issue's: accumulation not averaged, eval accuracy inverted)
    Mutant("accumulation_not_averaged", "moetrain/train/trainer.py",
           "((loss + aux) / accum).backward()", "(loss + aux).backward()",
           STEP_TESTS, "gradient accumulation sums the micro-batches instead of averaging them"),
    Mutant("aux_not_trained", "moetrain/train/trainer.py",
           "((loss + aux) / accum).backward()", "(loss / accum).backward()",
           STEP_TESTS, "the routers' aux loss is logged but not trained"),
    Mutant("clip_ignored", "moetrain/train/trainer.py",
           "max_norm = self.cfg.grad_clip\n", "max_norm = 0.0\n",
           STEP_TESTS, "trainer.grad_clip ignored"),
    Mutant("eval_counts_wrong_predictions", "moetrain/train/trainer.py",
           "correct += int((logits.argmax(dim=-1) == targets)[scored].sum())",
           "correct += int((logits.argmax(dim=-1) != targets)[scored].sum())",
           STEP_TESTS, "eval accuracy counts the wrong predictions"),
    Mutant("eval_leaves_eval_mode", "moetrain/train/trainer.py",
           "        self.model.train()\n        metrics = {", "        metrics = {",
           STEP_TESTS, "training goes on in eval mode after an evaluation"),
    Mutant("nonfinite_never_stops", "moetrain/train/trainer.py",
           "if self.cfg.on_nonfinite == NonFinite.stop:", "if False:",
           ("tests/cli/test_exit_codes.py",), "a NaN loss is skipped even when the run should stop"),
    # ---- steps decided on the device (bf16 parameters: MasterWeightAdamW reads the flags)
    Mutant("previous_step_never_read", "moetrain/train/trainer.py",
           "            self._settle()  # the step before this one", "            pass  # the step before this one",
           TRAIN_TESTS, "the host reads a step decided on the device only at checkpoints: a NaN step goes unnoticed"),
    Mutant("skipped_step_counted", "moetrain/train/optim.py",
           'self.state[param]["step"] -= 1', "pass",
           TRAIN_TESTS + ("tests/train/test_master_weights.py",),
           "a step the device skipped still advances Adam's bias correction"),
    Mutant("found_inf_ignored_by_the_kernel", "moetrain/ops/adamw.py",
           "elements = tl.where(tl.load(found_inf_ptr) != 0, 0, elements)", "elements = elements",
           ("tests/train/test_master_weights.py",), "the optimizer kernel updates a step flagged as skipped"),
    Mutant("gate_moves_on_a_skipped_step", "moetrain/moe/sigmoid_gate.py",
           "self.expert_bias += torch.where(skip, 0.0, move_E)", "self.expert_bias += move_E",
           LAYER_TESTS, "the load-balancing bias moves on a step that was skipped"),
    Mutant("lm_step_times_fp32_moments", "benchmarks/lm_step.py",
           'moments = torch.bfloat16 if args.optimizer == "master-bf16" else torch.float32', "moments = torch.float32",
           ("tests/bench/test_lm_step.py",), "the side-by-side benchmark's master-bf16 times fp32 moments"),
    Mutant("stochastic_rounding_truncates", "moetrain/ops/adamw.py",
           "rounded = (((bits + noise) >> 16) << 16)", "rounded = ((bits >> 16) << 16)",
           ("tests/train/test_master_weights.py",), "the kernel truncates bf16 weights without masters toward zero"),
    Mutant("stochastic_rounding_nearest_on_the_cpu", "moetrain/ops/adamw.py",
           "    param.copy_(stochastic_round(master, seed))", "    param.copy_(master)",
           ("tests/train/test_master_weights.py",), "bf16 weights without masters are rounded to nearest off the GPU"),
    Mutant("bf16_moments_never_stored", "moetrain/ops/adamw.py",
           "    if m is not exp_avg:\n        exp_avg.copy_(m)\n", "",
           ("tests/train/test_master_weights.py",), "AdamW's bf16 first moment is computed but never stored"),
    # ---- checkpoints
    Mutant("rng_not_restored", "moetrain/train/checkpoint.py",
           '    torch.set_rng_state(state["torch"])\n', "",
           TRAIN_TESTS, "a resumed run does not restore torch's generator"),
    Mutant("keep_one_too_many", "moetrain/train/checkpoint.py",
           "(complete[:-keep] if keep else [])", "(complete[:-keep - 1] if keep else [])",
           TRAIN_TESTS, "pruning keeps one checkpoint too many"),
    Mutant("resume_forgets_scheduler", "moetrain/train/trainer.py",
           "        self.scheduler.set_step(self.step)\n", "",
           TRAIN_TESTS, "a resumed run restarts the learning-rate schedule"),
    # ---- data
    Mutant("stream_resumes_at_wrong_sample", "moetrain/train/stream.py",
           "sampler=order[self.position * self.batch_size :].tolist()", "sampler=order[self.position :].tolist()",
           ("tests/data/test_data.py",), "a resumed data stream restarts at the wrong sample"),
    Mutant("lm_targets_not_shifted", "moetrain/data/text.py",
           "inputs, targets = window[:-1], window[1:]", "inputs, targets = window[:-1], window[:-1]",
           ("tests/data/test_lm_data.py",), "language-model targets are the inputs, not the next tokens"),
    Mutant("document_ids_off_by_one", "moetrain/data/text.py",
           'side="right")', 'side="left")',
           ("tests/data/test_tokenizers.py",), "a document's end-of-text token is counted in the next document"),
    Mutant("shard_drops_end_of_text", "moetrain/data/shards.py",
           "pieces += [np.asarray(ids, dtype=dtype), eos]", "pieces += [np.asarray(ids, dtype=dtype)]",
           ("tests/data/test_tokenizers.py",), "token shards join documents without the end-of-text token"),
    Mutant("bits_per_byte_counts_special_tokens", "moetrain/evaluate.py",
           "text_nats += float(losses_N[bytes_N > 0].double().sum())",
           "text_nats += float(losses_N[scored_N].double().sum())",
           ("tests/data/test_tokenizers.py",), "bits per byte add the end-of-text token's nats to the text's"),
    Mutant("resumed_shards_not_verified", "moetrain/data/shards.py",
           "_verify_recorded(out, recorded[index], text_sha256)", "pass",
           ("tests/data/test_tokenizers.py",), "a re-run of moetrain tokenize keeps shards of a changed corpus"),
    Mutant("tokenizer_larger_than_the_model", "moetrain/cli.py",
           "if isinstance(size, int) and needed > size:", "if False:",
           ("tests/data/test_text_runs.py",), "a tokenizer with more ids than model.vocab_size is not refused"),
    Mutant("document_mask_ignored", "moetrain/models/lm.py",
           "mask = document_mask(document_ids, causal=True, flex=document_ids.is_cuda and not dropout)",
           "mask = None",
           ("tests/models/test_document_mask.py",), "packed documents attend to the documents before them"),
    Mutant("rotary_positions_not_restarted", "moetrain/models/lm.py",
           "positions_B1T = document_positions(document_ids)[:, None]",
           "positions_B1T = torch.arange(T, device=document_ids.device).expand_as(document_ids)[:, None]",
           ("tests/models/test_document_mask.py",), "rotary positions run on across packed documents"),
    # ---- models
    Mutant("vision_no_position_embedding", "moetrain/models/vision.py",
           "x_BPD = self.dropout(x_BPD + self.pos_embed)", "x_BPD = self.dropout(x_BPD)",
           ("tests/models/test_models_vision.py",), "the ViT forgets its position embedding"),
    Mutant("vision_mean_pool_skips_a_patch", "moetrain/models/vision.py",
           'pooled_BD = x_BPD[:, 0] if self.pool == "cls" else x_BPD.mean(dim=1)',
           'pooled_BD = x_BPD[:, 0] if self.pool == "cls" else x_BPD[:, 1:].mean(dim=1)',
           ("tests/models/test_models_vision.py",), "mean pooling drops the first patch"),
    # ---- CLI (the issue's: exit code of a failed run)
    Mutant("exit_code_training_failed", "moetrain/command_errors.py", "EXIT_TRAINING_FAILED = 1", "EXIT_TRAINING_FAILED = 3",
           ("tests/cli/test_exit_codes.py",), "a failed training run exits 3"),
    Mutant("exit_code_interrupted", "moetrain/command_errors.py", "EXIT_INTERRUPTED = 130", "EXIT_INTERRUPTED = 1",
           ("tests/cli/test_exit_codes.py",), "Ctrl-C exits 1"),
    Mutant("exit_code_config_error", "moetrain/command_errors.py", "EXIT_CONFIG_ERROR = 2", "EXIT_CONFIG_ERROR = 1",
           ("tests/cli/test_exit_codes.py",), "a configuration mistake exits 1"),
    # ---- quantization (the issue's: an MXFP4 scale one binade off)
    Mutant("mxfp4_scale_binade_up", "moetrain/precision/formats.py",
           "exponent - 1 - E2M1_EMAX", "exponent - E2M1_EMAX",
           QUANT_TESTS, "the MXFP4 shared scale one binade too large"),
    Mutant("mxfp4_dequantize_binade", "moetrain/precision/formats.py",
           'return (value_NBS * e8m0_decode(q["scale"]).unsqueeze(-1)).flatten(-2)[..., :k]',
           'return (value_NBS * 2 * e8m0_decode(q["scale"]).unsqueeze(-1)).flatten(-2)[..., :k]',
           QUANT_TESTS, "MXFP4 decodes with twice its scale"),
    Mutant("nvfp4_tensor_scale", "moetrain/precision/formats.py",
           "amax / (E4M3_MAX * E2M1_MAX)", "amax / E4M3_MAX",
           QUANT_TESTS, "the NVFP4 tensor scale ignores E2M1's range"),
    Mutant("fp8_block_scale", "moetrain/precision/formats.py",
           "w_NbSKbS / scale_NbKb[..., :, None, :, None]", "w_NbSKbS / scale_NbKb[..., :, None, :, None] / 2",
           QUANT_TESTS, "FP8 128x128 blocks stored at half their scale (saturating)"),
    Mutant("fp8_token_rows_from_the_wrong_token", "moetrain/precision/fp8_matmul.py",
           "torch.arange(tokens * top_k, device=dest_TK.device) // top_k",
           "torch.arange(tokens * top_k, device=dest_TK.device) % tokens",
           ("tests/precision/test_fp8_training.py",), "FP8 training gathers each expert row from the wrong token"),
    Mutant("fp8_token_padding_not_zero", "moetrain/precision/fp8_matmul.py",
           "return _gather_rows(xq_TK, source_R, 0.0),", "return _gather_rows(xq_TK, source_R, 56.0),",
           ("tests/precision/test_fp8_training.py",),
           "FP8 rows no token fills hold 1.0 (byte 56), not zero: their outputs are never read, but with "
           "fp8_wgrad='fp8' the next GEMM's per-expert column scales see them"),
    Mutant("fp8_exchange_weight_gradient_from_undequantized_rows", "moetrain/precision/fp8_matmul.py",
           "x_RK = dequantize_rows_of(ctx.precision, xq_RK, x_scale_R).to(ctx.dtype)",
           "x_RK = xq_RK.float().to(ctx.dtype)",
           ("tests/precision/test_fp8_exchange.py",), "the expert's rank takes the weight gradient from E4M3 values without "
           "their scales"),
    Mutant("fp8_wgrad_setting_swapped", "moetrain/precision/fp8_matmul.py",
           '    if wgrad == "bf16":\n        return bf16_weight_grad(',
           '    if wgrad != "bf16":\n        return bf16_weight_grad(',
           ("tests/precision/test_fp8_training.py",), "fp8_wgrad='bf16' takes the weight gradient in FP8, and 'fp8' in bf16"),
    Mutant("trainer_drops_fp8_wgrad", "moetrain/moe/__init__.py",
           "layer.fp8_wgrad = fp8_wgrad", 'layer.fp8_wgrad = "bf16"',
           ("tests/precision/test_fp8_training.py",), "trainer.fp8_wgrad=fp8 is ignored: the weight gradient stays bf16"),
    Mutant("fp8_exchange_gradient_returns_unordered", "moetrain/parallel/expert.py",
           "return collectives.all_to_all_single(rows.index_select(0, self.back), self.send_rows, self.recv_rows,",
           "return collectives.all_to_all_single(rows, self.send_rows, self.recv_rows,",
           ("tests/precision/test_fp8_exchange.py",), "results and input gradients go back in expert-major order, not in the "
           "order their rows came"),
    # ---- training from a published checkpoint (model=hf) and writing it back
    Mutant("export_keeps_float32_master_weights", "moetrain/models/hf.py",
           "tensors = {name: tensor.to(source.dtypes.get(name, tensor.dtype)) for name, tensor in tensors.items()}",
           "tensors = dict(tensors)",
           PRETRAINED_TESTS, "a bf16 checkpoint's export is written in float32, not in its own dtype"),
    Mutant("checkpoint_routing_not_composed", "moetrain/cli.py",
           "ConfigStore.instance().store(group=\"routing\", name=PRETRAINED_ROUTING, node=routing)",
           "ConfigStore.instance().store(group=\"routing\", name=PRETRAINED_ROUTING, node={})",
           PRETRAINED_TESTS, "model=hf trains with the default gate, not the checkpoint's routing"),
    Mutant("checkpoint_balance_weight_ignored", "moetrain/models/hf.py",
           'routing["balance_loss_weight"] = float(weight)', "pass",
           PRETRAINED_TESTS, "router_aux_loss_coef of config.json is not the run's balance-loss weight"),
    Mutant("checkpoint_sizes_overridable", "moetrain/cli.py",
           "fixed = [key for key in config.model if key in FIXED_BY_CHECKPOINT]", "fixed = []",
           PRETRAINED_TESTS, "+model.num_experts=8 on a checkpoint is accepted"),
    Mutant("export_drops_the_tokenizer", "moetrain/export.py",
           "shutil.copytree(tokenizer, directory, dirs_exist_ok=True)", "pass",
           PRETRAINED_TESTS, "moetrain export leaves the run's tokenizer files behind"),
]


def copy_tree(target: Path) -> None:
    """The package laid out as the installed one imports it (conf, recipes and csrc inside moetrain/),
    the tests and the benchmarks."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build")
    shutil.copytree(ROOT / "moetrain", target / "moetrain", ignore=ignore)
    for name in ("conf", "recipes", "csrc"):
        shutil.copytree(ROOT / name, target / "moetrain" / name, ignore=ignore)
    shutil.copytree(ROOT / "tests", target / "tests", ignore=ignore)
    shutil.copytree(ROOT / "benchmarks", target / "benchmarks", ignore=ignore)  # the benchmarks' tests import them
    shutil.copy2(ROOT / "pyproject.toml", target / "pyproject.toml")


def environment(target: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_tests(target: Path, tests, timeout: float) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not cuda and not multigpu",
               *tests]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=target, env=environment(target), capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.monotonic() - started
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def first_failure(output: str) -> str:
    match = re.search(r"^(FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return match.group(2) if match else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutant names")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests on the unmutated copy")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    args = parser.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {m.name for m in MUTANTS})
        if unknown:
            parser.error(f"unknown mutants {unknown}; see --list")
        mutants = [m for m in MUTANTS if m.name in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.name:38s} {m.path:32s} {' '.join(m.tests)}\n{'':38s} {m.why}")
        return 0

    stale = [m for m in mutants if (ROOT / m.path).read_text().count(m.before) != 1]
    for m in stale:
        print(f"stale mutant {m.name}: its original text is not exactly once in {m.path}", file=sys.stderr)
    if stale:
        return 2

    with tempfile.TemporaryDirectory(prefix="moetrain_mutation_") as tmp:
        target = Path(tmp)
        copy_tree(target)
        where = subprocess.run([sys.executable, "-c", "import moetrain; print(moetrain.__file__)"], cwd=target,
                               env=environment(target), capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(target)):
            print(f"the copy is not what Python imports (moetrain from {where!r})", file=sys.stderr)
            return 2
        if not args.no_baseline:
            files = sorted({test for m in mutants for test in m.tests})
            code, output, seconds = run_tests(target, files, args.timeout * 2)
            print(f"baseline: {len(files)} test files, exit {code} in {seconds:.0f} s", flush=True)
            if code != 0:
                print(output[-3000:], file=sys.stderr)
                print("the unmutated copy fails its tests: fix that first", file=sys.stderr)
                return 2
        results = []
        for m in mutants:
            path = target / m.path
            original = path.read_text()
            path.write_text(original.replace(m.before, m.after))
            try:
                code, output, seconds = run_tests(target, m.tests, args.timeout)
            finally:
                path.write_text(original)
            status = {0: "SURVIVED", 1: "killed"}.get(code, f"error (exit {code})")
            caught_by = first_failure(output) if code == 1 else ""
            results.append((m, status))
            print(f"{status:9s} {m.name:38s} {seconds:5.0f} s  {caught_by}", flush=True)
            if code not in (0, 1):
                print(output[-2000:], file=sys.stderr)

    survivors = [m for m, status in results if status == "SURVIVED"]
    errors = [m for m, status in results if status not in ("SURVIVED", "killed")]
    print(f"\n{len(results)} mutants: {len(results) - len(survivors) - len(errors)} killed, {len(survivors)} survived, "
          f"{len(errors)} errors")
    for m in survivors:
        print(f"  survived: {m.name} ({m.path}): {m.why}")
    return 1 if survivors or errors else 0


if __name__ == "__main__":
    sys.exit(main())
