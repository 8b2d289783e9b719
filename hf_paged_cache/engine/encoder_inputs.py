"""Encoder-decoder requests in a continuous batcher: the encoder's input of each, and the forwards that read it.

An encoder-decoder request (T5, BART, Marian, Whisper) is two inputs: what the encoder reads (source token ids,
or a Whisper model's log-mel features) and the decoder's prompt (its start token, or Whisper's task tokens),
which the batcher schedules as it schedules any prompt. The encoder runs when a request's first prompt chunk
runs, batched with the other requests whose first chunk runs in that step (`encode`: token ids right-padded
to the longest under the encoder's mask, features of one shape stacked). Its output waits on the request until
that chunk's forward has put the cross-attention keys and values in the pool, and is dropped then; a request
computed again after a preemption encodes again.

The decode rows of the running batch read their cross-attention keys and values from the cache alone: their
forward gets the cross-attention's `encoder_mask` (the rows' encoder inputs may differ in length) and, as the
encoder's output, zeros of the right shape that no layer reads (`encoder_stand_in`). The decoder's positions
are each row's own: through ``decoder_position_ids`` where the model takes them (Whisper), through its position
embedding's ``position_ids`` otherwise (`row_positions`: BART, mBART, Marian compute them from the cache's
length, which a left-padded row does not have), and not at all for relative positions (T5), which padding
does not move.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput


@dataclass
class EncoderInput:
    """A request's encoder input, and the encoder's output for it while its first prompt chunk needs it."""

    inputs: dict[str, torch.Tensor]  # {"input_ids": [1, S]} or {"input_features": [1, mel bins, frames]}
    hidden: torch.Tensor | None = None  # [1, S', d] the encoder's output, until the first chunk has kept it

    @property
    def name(self) -> str:
        return next(iter(self.inputs))


def encoder_input(
    model: PreTrainedModel, input_ids: Sequence[int] | torch.Tensor | None, input_features: torch.Tensor | None
) -> EncoderInput:
    """A checked encoder input for `model`: source token ids (T5, BART, Marian), or for a model that reads
    features (Whisper: ``model.main_input_name == "input_features"``) a ``[mel bins, frames]`` float tensor.
    `ValueError` names what is wrong."""
    name = model.main_input_name
    if name == "input_features":
        if input_features is None or input_ids is not None:
            raise ValueError(f"{type(model).__name__} reads input_features (log-mel features), not token ids")
        features = torch.as_tensor(input_features)
        if features.ndim == 3 and features.shape[0] == 1:
            features = features[0]
        bins = getattr(model.config, "num_mel_bins", None)
        if features.ndim != 2 or not features.is_floating_point() or (bins and features.shape[0] != bins):
            raise ValueError(f"input_features must be a float tensor [{bins or 'mel bins'}, frames], "
                             f"got {features.dtype} {tuple(features.shape)}")
        return EncoderInput({"input_features": features.to(model.device, model.dtype).unsqueeze(0)})
    if input_features is not None:
        raise ValueError(f"{type(model).__name__} reads token ids, not input_features")
    if input_ids is None:
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model: submit() needs the encoder's input_ids")
    ids = torch.as_tensor(input_ids)
    vocab = model.get_input_embeddings().num_embeddings
    if ids.ndim != 1 or ids.is_floating_point() or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"the encoder's input_ids must be a non-empty 1-D list of token ids below {vocab}")
    config = model.config
    longest = getattr(config, "max_source_positions", None) or getattr(config, "max_position_embeddings", None)
    if longest is not None and len(ids) > longest:
        raise ValueError(f"the encoder's input is {len(ids)} tokens; {type(model).__name__} reads at most {longest}")
    return EncoderInput({"input_ids": ids.to(model.device).unsqueeze(0)})


def encode(model: PreTrainedModel, inputs: Sequence[EncoderInput]) -> None:
    """Run the encoder for every input without an output yet, batched (see the module docstring); each gets its
    `hidden` ``[1, S, d]``."""
    pending = [item for item in inputs if item.hidden is None]
    if not pending:
        return
    encoder = model.get_encoder()
    features = [item for item in pending if item.name == "input_features"]
    for shape in {item.inputs["input_features"].shape for item in features}:
        batch = [item for item in features if item.inputs["input_features"].shape == shape]
        hidden = encoder(input_features=torch.cat([item.inputs["input_features"] for item in batch])).last_hidden_state
        for row, item in enumerate(batch):
            item.hidden = hidden[row : row + 1]
    texts = [item for item in pending if item.name == "input_ids"]
    if texts:
        lengths = [item.inputs["input_ids"].shape[1] for item in texts]
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        ids = torch.full((len(texts), max(lengths)), pad, dtype=torch.long, device=model.device)  # [n, S]
        mask = torch.zeros_like(ids)
        for row, (item, length) in enumerate(zip(texts, lengths)):
            ids[row, :length], mask[row, :length] = item.inputs["input_ids"][0], 1
        hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # [n, S, d]
        for row, (item, length) in enumerate(zip(texts, lengths)):
            item.hidden = hidden[row : row + 1, :length]


def encoder_stand_in(model: PreTrainedModel, mask: torch.Tensor) -> BaseModelOutput:
    """The encoder's output for a forward whose cross-attention reads every key and value from the cache: zeros
    ``[B, S, d]`` (one element, expanded), which give the cross-attention mask its shape and are never read."""
    hidden = torch.zeros((), device=mask.device, dtype=model.dtype).expand(*mask.shape, model.config.d_model)
    return BaseModelOutput(last_hidden_state=hidden)


def takes_decoder_positions(model: PreTrainedModel) -> bool:
    """Whether `model`'s forward takes ``decoder_position_ids`` (Whisper)."""
    return "decoder_position_ids" in inspect.signature(model.forward).parameters


def check_positions(model: PreTrainedModel) -> None:
    """`NotImplementedError`, naming the model, unless its decoder's positions can follow each row
    (`row_positions`): a left-padded row would otherwise read another position's embedding."""
    if takes_decoder_positions(model):
        return
    embedding = getattr(model.get_decoder(), "embed_positions", None)
    if embedding is None:
        if getattr(model.config, "model_type", None) in _RELATIVE_POSITIONS:
            return
    elif "position_ids" in inspect.signature(embedding.forward).parameters:
        return
    raise NotImplementedError(
        f"the continuous batcher cannot give {type(model).__name__}'s decoder each row's own positions (its decoder "
        "takes no position ids): generate with cache=PagedCache(model) runs it"
    )


_RELATIVE_POSITIONS = {"t5", "mt5", "umt5", "longt5", "switch_transformers"}  # relative attention buckets only


@contextlib.contextmanager
def row_positions(model: PreTrainedModel, positions: torch.Tensor) -> Iterator[dict[str, torch.Tensor]]:
    """For one forward: each row's decoder positions ``[B, q]``. Yields the forward arguments that carry them
    (``decoder_position_ids`` where the model takes them); otherwise, while the context lasts, the decoder's
    position embedding answers with each row's embedding of its own ``position_ids`` (a forward hook, removed
    on exit: BART's, mBART's and Marian's embeddings take one row's positions); a model of relative positions
    needs neither."""
    if takes_decoder_positions(model):
        yield {"decoder_position_ids": positions}
        return
    embedding = getattr(model.get_decoder(), "embed_positions", None)
    if embedding is None:
        yield {}
        return

    def own_positions(module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        # the embedding of each row's positions ``[q]`` (called past the hooks), stacked: [B, q, d]
        rows = [type(module).forward(module, *args, **{**kwargs, "position_ids": row}) for row in positions]
        return torch.stack([row.reshape(positions.shape[1], -1) for row in rows])

    handle = embedding.register_forward_hook(own_positions, with_kwargs=True)
    try:
        yield {}
    finally:
        handle.remove()
