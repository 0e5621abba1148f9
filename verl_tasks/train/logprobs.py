"""Log-probabilities of response tokens without a ``[batch, length, vocabulary]`` tensor.

A causal LM's ``forward`` projects every position onto the vocabulary: for 256 sequences of
1,024 tokens and a 151,936-token vocabulary that is 160 GB in float32, and autograd keeps it.
:class:`ResponseLogProbs` runs the model's decoder for hidden states, keeps only the response
positions, and applies the LM head, ``log_softmax`` and the entropy to chunks of
:func:`chunk_tokens` tokens. Each chunk is recomputed in backward (non-reentrant checkpoint), so
one chunk's logits are alive at a time, in forward and in backward.

It is an ``nn.Module`` around the causal LM, so the update calls it as *the* model: DDP
synchronises the gradients of a forward run through it, and FSDP2 (with it as the root)
gathers the embeddings and the LM head in its pre-forward hook. Parameter names, which the
checkpoints and the optimizer state use, stay the causal LM's (``.lm``).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from verl_tasks.algos import entropy_from_logprobs
from verl_tasks.errors import ConfigError

# Logits elements alive at once (one chunk): 64 MiB in float32, whatever the vocabulary.
LOGITS_BUDGET = 1 << 24
# Config attributes with which transformers' causal LMs change the logits after the LM head
# (transformers 5.19: Gemma 2/3/4 and VaultGemma softcapping, Cohere's scale, Granite's and
# HyperCLOVA X's scaling, RecurrentGemma's cap, Falcon-H1's and MuseGlimmer's multipliers, Inkling's
# vocabulary cut). Value that changes nothing: None, or 1 for a scale.
POST_LM_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap",
                "lm_head_multiplier", "output_multiplier", "unpadded_vocab_size")


def chunk_tokens(vocab_size: int) -> int:
    """Response tokens per LM-head chunk: ``LOGITS_BUDGET`` logits elements (at least one token)."""
    return max(1, LOGITS_BUDGET // vocab_size)


def refuse_logit_post_processing(lm: Any) -> None:
    """Raise ConfigError when ``lm``'s logits are not ``lm_head(decoder(x))``: this route would skip the rest."""
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", type(lm).__name__)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    changed = [f"{name}={value}" for name in POST_LM_HEAD
               for value in [getattr(text, name, None)] if value is not None and value != 1]
    if changed:
        raise ConfigError(f"model type {model_type!r} post-processes its logits after the LM head "
                          f"({', '.join(changed)}); the update computes log-probs from the decoder's hidden states "
                          f"and the LM head in chunks and would skip that, so {model_type} models are not supported")
    if not hasattr(lm, "get_decoder") or lm.get_output_embeddings() is None or lm.get_decoder() is lm:
        raise ConfigError(f"model type {model_type!r} exposes no separate decoder and LM head (get_decoder, "
                          f"get_output_embeddings); the update needs both to compute log-probs in chunks")


class ResponseLogProbs(torch.nn.Module):
    """The causal LM ``lm`` as the update calls it: ``forward`` returns response log-probs and entropies.

    ``autocast``: the compute dtype when it is narrower than the parameters' (float32 master
    weights, bfloat16 compute); None computes in the parameters' dtype (or FSDP2's mixed precision).
    """

    def __init__(self, lm: torch.nn.Module, autocast: torch.dtype | None = None):
        super().__init__()
        refuse_logit_post_processing(lm)
        self.lm: Any = lm  # an HF causal LM: get_decoder, get_output_embeddings
        self.autocast = autocast

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                response_ids: torch.Tensor, response_mask: torch.Tensor, temperature: float,
                with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities ``[B, R]`` of ``response_ids`` (logits divided by ``temperature``), and the
        entropies ``[B, R]`` of those distributions (or None); 0 where ``response_mask`` is 0.

        ``positions [B, R]``: the position whose logits predict each response token.
        """
        precision = (torch.autocast(input_ids.device.type, dtype=self.autocast) if self.autocast is not None
                     else nullcontext())
        with precision:
            hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                           use_cache=False).last_hidden_state
            rows, cols = response_mask.nonzero(as_tuple=True)
            keep = 1.0
            if len(rows) == 0:  # no response token: one at weight 0, so the backward still reaches every parameter
                rows = cols = torch.zeros(1, dtype=torch.long, device=input_ids.device)  # (workers wait for them)
                keep = 0.0
            picked = hidden[rows, positions[rows, cols]]  # [N, D]: the response positions only
            targets = response_ids[rows, cols]
            head = self.lm.get_output_embeddings()
            size = chunk_tokens(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])
            parts = [self._chunk(head, h, t, temperature, with_entropy)
                     for h, t in zip(picked.split(size), targets.split(size), strict=True)]
        shape = response_ids.shape
        logp = _scatter(shape, rows, cols, [p[0] for p in parts]) * keep
        entropy = _scatter(shape, rows, cols, [p[1] for p in parts]) * keep if with_entropy else None
        return logp, entropy

    def _chunk(self, head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
               with_entropy: bool) -> tuple[torch.Tensor, ...]:
        if torch.is_grad_enabled():  # keep only this chunk's inputs; its logits are made again in backward
            return checkpoint(_chunk_logprobs, head, hidden, targets, temperature, with_entropy, use_reentrant=False)
        return _chunk_logprobs(head, hidden, targets, temperature, with_entropy)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """``[n]`` log-probs of ``targets`` (and entropies) from ``[n, D]`` hidden states; float32 softmax."""
    log_probs = torch.log_softmax(head(hidden).float() / temperature, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return (logp,)
    return logp, entropy_from_logprobs(log_probs)


def _scatter(shape: torch.Size, rows: torch.Tensor, cols: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, device=rows.device).index_put((rows, cols), torch.cat(parts))
