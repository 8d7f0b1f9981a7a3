"""Text generation from a language model: greedy or sampled (temperature, top-k, top-p), streamed.

    from moetrain import load_run
    from moetrain.generate import stream_text
    run = load_run("runs/..._lm")
    for piece in stream_text(run, "Once upon a time", max_new_tokens=200, temperature=0.8, top_p=0.95, seed=0):
        print(piece, end="", flush=True)

Token by token: the model reads the last max_seq_len tokens (prompt and generated so far), its
logits at the last position are divided by the temperature, cut to the top_k largest, then to the
smallest set of tokens whose probability reaches top_p, and the next token is drawn from the
softmax of what is left (temperature 0: the largest logit, no draw). The model has no key/value
cache, so every token costs one forward pass over the window: fine for the models moetrain trains
on a CPU, slow for long outputs of large ones.

Draws use a CPU generator seeded by `seed`, so a seed gives the same tokens on every device as long
as the logits agree. Text runs (data=text on text files or token shards) take and give text
through the run's tokenizer (the byte-level one, or the tokenizer.json copied into the run
directory), stop at its end-of-text token, and stream whole characters; runs on token ids without
a tokenizer (token files, the synthetic language) take and give ids.

Shape letters: B batch, T positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from moetrain.run import Run, RunError


class GenerationError(RunError):
    """A generation setting or prompt that cannot be used: one line naming it and the fix."""


# ---- filtering and drawing ----------------------------------------------------------------------
def top_k_filter(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    """Logits outside each row's k largest set to -inf (k = 0 or k >= V: unchanged). Ties with the
    k-th largest stay."""
    if k <= 0 or k >= logits_BV.size(-1):
        return logits_BV
    kth_B1 = torch.topk(logits_BV, k, dim=-1).values[..., -1:]
    return logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))


def top_p_filter(logits_BV: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep, per row, the most probable tokens until their probabilities sum to
    at least p (always the most probable one); the others set to -inf. p = 1: unchanged."""
    if p >= 1.0:
        return logits_BV
    sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
    probs_BV = torch.softmax(sorted_BV.float(), dim=-1)
    mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV  # probability of the tokens ranked above
    drop_sorted_BV = mass_before_BV >= p
    drop_sorted_BV[..., 0] = False
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def check_settings(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    """Raise GenerationError for a setting out of range."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0 and temperature != float("inf")):
        raise GenerationError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise GenerationError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise GenerationError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def next_tokens(logits_BV: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token id per row [B] from last-position logits [B, V] (see the module doc)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    filtered_BV = top_p_filter(top_k_filter(logits_BV.float().cpu() / temperature, top_k), top_p)
    probs_BV = torch.softmax(filtered_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1).to(logits_BV.device)


# ---- generation ----------------------------------------------------------------------------------
def _context_length(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    length = getattr(config, "max_seq_len", None)
    if not isinstance(length, int):
        raise GenerationError(f"{type(model).__name__} is not a language model (it has no config.max_seq_len): "
                              "generate from a run trained on language-modelling data")
    return length


@torch.no_grad()
def stream_tokens(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                  eos_id: int | None = None, vocab_limit: int | None = None) -> Iterator[int]:
    """Yield each new token id as soon as it is chosen: max_new_tokens of them, fewer when eos_id
    is given and drawn (it is yielded, then generation stops). With vocab_limit, ids at or above it
    are never drawn: a model's embedding may be padded past its tokenizer's ids (published
    checkpoints are), and the padding rows are no token."""
    check_settings(temperature, top_k, top_p, max_new_tokens)
    context = _context_length(model)
    vocab_size = model.config.vocab_size
    tokens = [int(token) for token in prompt_ids]
    if not tokens:
        raise GenerationError("the prompt is empty: give at least one token")
    bad = [token for token in tokens if not 0 <= token < vocab_size]
    if bad:
        raise GenerationError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # a fresh random seed, not drawn from (nor moving) the global generator
    else:
        generator.manual_seed(seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            window_1T = torch.tensor([tokens[-context:]], dtype=torch.long, device=device)
            logits_1V = model(window_1T)[:, -1]
            if vocab_limit is not None and vocab_limit < logits_1V.size(-1):
                logits_1V[:, vocab_limit:] = float("-inf")
            token = int(next_tokens(logits_1V, temperature, top_k, top_p, generator)[0])
            tokens.append(token)
            yield token
            if token == eos_id:
                return
    finally:
        model.train(was_training)


def generate(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, eos_id: int | None = None,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """The new token ids (stream_tokens collected); on_token is called with each as it comes."""
    generated = []
    for token in stream_tokens(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id):
        generated.append(token)
        if on_token is not None:
            on_token(token)
    return generated


# ---- from a run ----------------------------------------------------------------------------------
def prompt_ids(run: Run, prompt: str | Sequence[int]) -> list[int]:
    """A prompt as token ids: text through the run's tokenizer, after the end-of-text token (the
    prompt starts a new document, as every document after the first did in training), or ids as
    they are."""
    if run.task != "language_modeling":
        raise GenerationError(f"the run at {run.run_dir} is a {run.task} run: generation needs a language-model run")
    tokenizer = run.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError(
                f"this run trained on token ids ({run.config['data']['_target_']}) without a tokenizer: give the "
                "prompt as token ids (a list of integers)")
        return [tokenizer.eos_id] + tokenizer.encode(prompt)
    return [int(token) for token in prompt]


def stream_text(run: Run, prompt: str | Sequence[int], max_new_tokens: int = 100, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Iterator[str]:
    """Yield the generated text piece by piece for printing: whole characters for a run with a
    tokenizer (stopping at end-of-text), each token id followed by a space for an id run."""
    ids = prompt_ids(run, prompt)
    tokenizer = run.tokenizer
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    generated: list[int] = []
    shown = ""
    limit = tokenizer.vocab_size if tokenizer is not None else None  # only ids the tokenizer can decode
    for token in stream_tokens(run.model, ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id, limit):
        if tokenizer is None:
            yield f"{token} "
            continue
        if token == eos_id:
            break
        generated.append(token)
        # The whole output decoded again: a token may end inside a character (byte-level BPE, bytes),
        # which decodes as U+FFFD until the token that completes it comes.
        text = tokenizer.decode(generated)
        if not text.endswith("\ufffd") and len(text) > len(shown):
            yield text[len(shown):]
            shown = text
    if tokenizer is not None and len(text := tokenizer.decode(generated)) > len(shown):
        yield text[len(shown):]
