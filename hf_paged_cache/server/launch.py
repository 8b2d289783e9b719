"""What the serve command (`hf_paged_cache.serve`) and the Ray Serve application (`hf_paged_cache.server.ray`)
build alike from the command's options: the options themselves (`build_parser`), the model and the batcher on
it (`load_batcher`, which answers one request before the server says it is ready), the engine the HTTP app
runs (`load_engine`) and the app's settings (`server_settings`)."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..kernels.quantize import QUANTIZE_CHOICES
from ..models import DTYPE_CHOICES, load_model_and_tokenizer, resolve_dtype
from ..pool.kv_format import KV_DTYPES
from ..pool.memory import parse_memory

if TYPE_CHECKING:  # the serve extra may be missing: the functions import these only when they run
    import torch

    from ..engine.batcher import ContinuousBatcher
    from .http.engine import EngineClient
    from .http.metrics import ServerMetrics
    from .http.settings import ServerSettings

logger = logging.getLogger("hf_paged_cache.serve")

API_KEY_ENV = "HF_PAGED_CACHE_API_KEY"
OFFLINE_MODELS = {"default": None, "gemma-3-270m": "gemma-3-270m"}  # names load_model_and_tokenizer resolves


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_paged_cache.serve", description="OpenAI-compatible server on a ContinuousBatcher.",
    )
    parser.add_argument("model", help="Hub id, local folder, 'default' (SmolLM2-135M-Instruct) or 'gemma-3-270m'")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=_positive, default=8000)
    parser.add_argument("--served-model-name", help="the name clients use for the model (default: MODEL)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"bearer key the API needs (default: ${API_KEY_ENV}; none: no key)")
    parser.add_argument("--metrics-need-key", action="store_true", help="/metrics needs the API key too")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                        help="model and cache dtype; auto: bfloat16 where the device computes it natively, else "
                             "float32 (default: float32)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument(
        "--packed-linears", action=argparse.BooleanOptionalAction, default=True,
        help="on a CPU, run the model's linear layers through oneDNN on packed weights (hf_paged_cache.kernels): "
             "much faster small batches, float32 rounding apart the same products, twice the linear weights' "
             "memory (default: on; --no-packed-linears for the stock kernels)",
    )
    parser.add_argument(
        "--quantize", choices=QUANTIZE_CHOICES, default=None,
        help="weight-only int8 or int4 linear layers (hf_paged_cache.kernels.quantize_weights) but the output head, "
             "or int8-all / int4-all with it: a quarter (int8) or about a sixth (int4) of float32's weight memory, "
             "faster one-client decode steps; int8 makes prompts and large batches slower; the KV cache stays as the "
             "model computes it (default: off)",
    )
    parser.add_argument(
        "--time-linears", action="store_true",
        help="with --packed-linears, time each group of same-shaped linear layers on the stock kernels and packed, "
             "at 1, 4 and 16 rows, at start-up (a few seconds), and pack only the groups clearly faster packed on "
             "this CPU, products of fewer rows than where packing won keeping the stock kernel (default: pack "
             "every layer, for every product)",
    )
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument(
        "--bmm-decode", action="store_true",
        help="attend float32 decode steps by batched matrix products (the paged_bmm attention): faster at two "
             "threads and more, the same up to float32 rounding, not bit for bit (default: off, paged_sdpa)",
    )
    decode.add_argument(
        "--flex-decode", action="store_true",
        help="attend float32 decode steps on a CPU by a compiled flex_attention that reads the blocks in place (the "
             "paged_flex attention; compiled at start-up, a C++ compiler needed): no gather, the same up to float32 "
             "rounding, not bit for bit (default: off, paged_sdpa)",
    )
    parser.add_argument(
        "--pad-heap", action=argparse.BooleanOptionalAction, default=True,
        help="keep up to 64 MiB of freed memory per malloc arena (glibc's mallopt; hf_paged_cache.heap) "
             "instead of faulting it in again at every decode step: faster steps, more resident memory "
             "(default: on; --no-pad-heap for glibc's own settings; Ray replicas keep glibc's own)",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=_positive, help="KV blocks in every layer group (default: elastic pool)")
    pool.add_argument("--max-memory", type=_memory, help="KV memory for the pool, e.g. 2GiB (default: elastic pool)")
    parser.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES,
                        help="how the pool stores keys and values: int8 or float8_e4m3fn (8 bits and their scales "
                             "per token and head: about 3.5x the tokens of float32 in --max-memory), bfloat16, float16 "
                             "(default: as the model computes them, exact)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="each request's logits the same bits whatever other requests share its steps, and the "
                             "same when its text is scored (echo) as when it was generated (docs/determinism.md)")
    parser.add_argument("--compile", action="store_true",
                        help="run decode steps as one graph compiled by inductor around the paged attention (logits "
                             "equal to float32 rounding); the first request compiles it: about a minute for the "
                             "default model, less from inductor's disk cache (docs/performance-notes.md)")
    parser.add_argument("--reuse-prompt-scores", action=argparse.BooleanOptionalAction, default=True,
                        help="keep scored prompts' log-probabilities (echo, prompt_logprobs) by block, so a prompt "
                             "that starts with the same blocks computes only the rest (default: on)")
    parser.add_argument("--max-running", type=_positive, help="most requests in flight at once (default: 64)")
    parser.add_argument("--max-waiting", type=_positive, default=256,
                        help="most requests waiting to start; more get 429 (default: 256)")
    parser.add_argument("--max-step-tokens", type=_positive,
                        help="most prompt tokens prefilled per step (default: 512)")
    parser.add_argument("--speculative", type=_speculative, metavar="{ngram,draft:MODEL,off}",
                        help="speculative decoding, in the decode steps where it is expected to pay; the answers "
                             "are the same (greedy and seeded ones): ngram verifies draft tokens looked up in each "
                             "request's own prompt and answer; draft:MODEL those a smaller model with the same "
                             "tokenizer writes (a Hub id, a local path or an offline name, loaded as --model is); "
                             "off: one token per request and step (default: ngram, or off for a model with "
                             "conv / recurrent states, which cannot give back rejected drafts)")
    parser.add_argument("--speculative-tokens", type=_positive, default=4,
                        help="most draft tokens per request and step with --speculative (default: 4)")
    parser.add_argument(
        "--reserve-new-tokens", action=argparse.BooleanOptionalAction, default=False,
        help="admit a request only when the pool holds its prompt and all of max_tokens (never preempted); "
             "off by default: a request without max_tokens may take the whole context, and would reserve it "
             "(off: admitted while its prompt fits, preempted and recomputed if the pool runs out)",
    )
    parser.add_argument("--max-model-len", type=_positive,
                        help="most tokens of prompt and answer (default: the model's)")
    parser.add_argument("--max-n", type=_positive, default=16, help="most choices per request (default: 16)")
    parser.add_argument("--max-body-bytes", type=_positive, default=4 * 1024 * 1024,
                        help="largest request body; larger get 413 (default: 4 MiB: raise it for long audio uploads)")
    parser.add_argument("--max-images", type=_positive, default=8,
                        help="most images a chat request may carry, on an image-text model (default: 8)")
    parser.add_argument("--allow-image-urls", action="store_true",
                        help="fetch http(s) image URLs of chat messages (default: off, data: URLs only; the server "
                             "would fetch any address a client names)")
    parser.add_argument("--max-audio-seconds", type=_seconds, default=3600.0,
                        help="longest audio a speech model transcribes; longer gets 400 (default: 3600)")
    parser.add_argument("--max-schema-bytes", type=_positive, default=64 * 1024,
                        help="largest JSON schema, regex or grammar a request may send (default: 65536)")
    parser.add_argument("--grammar-compile-timeout", type=_seconds, default=10.0,
                        help="seconds a request's schema or grammar may take to compile; 400 beyond (default: 10)")
    parser.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json"],
                        help="how the model writes tool calls: <tool_call> tags (Hermes, Qwen, SmolLM) or Llama 3's "
                             "JSON (default: hermes)")
    parser.add_argument("--chat-template", type=Path, help="a Jinja chat template file, instead of the tokenizer's")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")
    parser.add_argument("--shutdown-grace", type=_seconds, default=30.0,
                        help="seconds requests in flight get to finish on SIGTERM / SIGINT (default: 30)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ray = parser.add_argument_group("Ray Serve (the ray extra: pip install 'hf_paged_cache[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve on a Ray Serve application: --replicas engine replicas, each with its own model, "
                          "batcher and pool, behind one HTTP ingress (hf_paged_cache.server.ray)")
    ray.add_argument("--replicas", type=_positive, default=1, help="engine replicas (default: 1)")
    ray.add_argument("--ray-address", help="an existing Ray cluster to join, e.g. ray://head:10001 or auto "
                                           "(default: start a local one)")
    ray.add_argument("--router", default="prefix", choices=["prefix", "pow2"],
                     help="how requests pick a replica: prefix (the one holding the longest cached prefix of the "
                          "prompt, balanced against load) or pow2 (Ray Serve's default, power of two choices) "
                          "(default: prefix)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each engine replica reserves "
                                                                     "(default: 1)")
    ray.add_argument("--replica-gpus", type=float, help="Ray GPUs each engine replica reserves (default: 1 with a "
                                                        "cuda --device, else 0)")
    ray.add_argument("--replica-threads", type=_positive,
                     help="torch threads of each engine replica (default: torch's own; set it when replicas share "
                          "a machine's cores)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _speculative(text: str) -> str:
    if text in ("ngram", "off") or (text.startswith("draft:") and text[len("draft:"):].strip()):
        return text
    raise argparse.ArgumentTypeError(f"expected ngram, draft:MODEL or off, got {text!r}")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def load_engine(options: argparse.Namespace, chat_template: str | None, metrics: ServerMetrics) -> EngineClient:
    """Load the model and tokenizer, build the batcher on them, and log the pool it holds."""
    from .http.engine import EngineClient

    batcher, tokenizer = load_batcher(options)
    processor = None
    if hasattr(batcher.model.config, "vision_config"):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(options.model, trust_remote_code=options.trust_remote_code)
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            chat_template = getattr(processor, "chat_template", None)  # the processor's renders image parts
    engine = EngineClient(batcher, tokenizer, max_model_len=options.max_model_len, chat_template=chat_template,
                          metrics=metrics)
    if processor is not None:
        from .http.images import ImageLimits
        from .http.vision import ImagePrompts

        limits = ImageLimits(max_images=options.max_images, allow_urls=options.allow_image_urls)
        engine.images = ImagePrompts(processor, limits)
        logger.info("reads images: at most %d a request, %s", limits.max_images,
                    "data and http(s) URLs" if limits.allow_urls else "data URLs only (--allow-image-urls: http too)")
    logger.info("context: %d tokens per request (prompt and answer)", engine.max_model_len)
    if batcher.model.main_input_name == "input_features":  # a speech model: /v1/audio/transcriptions
        from transformers import AutoFeatureExtractor

        from .http.transcription import Transcriber

        extractor = AutoFeatureExtractor.from_pretrained(options.model)
        engine.transcriber = Transcriber(engine, extractor, batcher.model.generation_config,
                                         max_seconds=options.max_audio_seconds)
        logger.info("transcribes audio of up to %g s, in windows of %g s", options.max_audio_seconds,
                    engine.transcriber.window_seconds)
    return engine


def load_batcher(options: argparse.Namespace) -> tuple[ContinuousBatcher, Any]:
    """Load the model and tokenizer of `options` (this command's), build the batcher on them and log its pool."""
    import torch

    from ..attention import set_paged_attention
    from ..engine.batcher import ContinuousBatcher
    from ..kernels import mkl_takes_fast_path

    dtype = resolve_dtype(options.dtype, options.device)
    logger.info("loading %s (%s on %s)", options.model, dtype, options.device)
    model, tokenizer = _load_model(options, dtype)
    if options.quantize is not None:
        from ..kernels import quantize_by_name

        logger.info("%s weights: %d linear layers quantized (weight-only; the output head %s)", options.quantize,
                    quantize_by_name(model, options.quantize), "too" if options.quantize.endswith("-all")
                    else "kept in float")
    _pack_linears(model, options, "")
    if torch.device(options.device).type == "cpu" and mkl_takes_fast_path() is False:
        logger.warning("MKL skips its fast kernels on this CPU (not an Intel one): SDPA's CPU kernels run up to "
                       "3x slower; see docs/serving.md, \"MKL on AMD CPUs\", for PyTorch's workaround")
    if options.bmm_decode:
        set_paged_attention(model, decode="products")
        logger.info("decode steps attend by batched products (%s)", model.config._attn_implementation)
    if options.flex_decode:
        set_paged_attention(model, decode="flex")
        logger.info("decode steps read the blocks in place (%s)", model.config._attn_implementation)
    batcher = ContinuousBatcher(
        model, num_blocks=options.num_blocks, max_memory=options.max_memory, block_size=options.block_size,
        max_running=options.max_running, max_waiting=options.max_waiting, max_step_tokens=options.max_step_tokens,
        tokenizer=tokenizer, reserve_new_tokens=options.reserve_new_tokens, kv_dtype=options.kv_dtype,
        speculative=_speculative_option(options, dtype, model), speculative_tokens=options.speculative_tokens,
        batch_invariant=options.batch_invariant, reuse_prompt_scores=options.reuse_prompt_scores,
        compile=options.compile,
    )
    _log_pool(batcher)
    if options.flex_decode:
        _compile_flex_decode(batcher)
    _answer_one_request(batcher, options)
    return batcher, tokenizer


def _answer_one_request(batcher: ContinuousBatcher, options: argparse.Namespace) -> None:
    """Run one request (a prompt of one token, two new tokens: a prefill and a decode step; a speech model's
    encoder hears a window of silence) through `batcher` before the server says it is ready, so that a
    configuration this machine cannot run (a dtype its CPU's kernels refuse, say) stops the server at start-up
    with its error instead of failing every request.

    Raises:
        RuntimeError: naming the model, dtype and device, from the request's own error (closing `batcher`).
    """
    import torch

    start = time.perf_counter()
    model = batcher.model
    try:
        if model.main_input_name == "input_features":  # Whisper: a window of silence's features
            frames = 2 * model.config.max_source_positions  # the encoder's stride-2 convolution halves them
            features = torch.zeros(model.config.num_mel_bins, frames)
            batcher.submit(input_features=features, max_new_tokens=2, min_new_tokens=2, do_sample=False).result()
        else:
            batcher.generate([[0]], max_new_tokens=2, min_new_tokens=2, do_sample=False)
    except Exception as error:
        batcher.close()
        raise RuntimeError(f"{options.model} cannot answer a request as configured (--dtype {options.dtype}, "
                           f"--device {options.device}): {type(error).__name__}: {error}") from error
    logger.info("answered a first request of one token in %.2f s", time.perf_counter() - start)


def _compile_flex_decode(batcher: ContinuousBatcher) -> None:
    """Compile ``paged_flex``'s kernel for each attention shape of the model before the first request."""
    from ..attention.flex_decode import kernel_takes, warm_up

    model, pool = batcher.model, batcher.pool
    if not kernel_takes(pool.dtype, model.device):
        logger.warning("paged_flex reads blocks in place in float32 on a CPU only: %s decode steps on %s gather as "
                       "paged_sdpa's", pool.dtype, model.device)
        return
    query_heads = model.config.get_text_config(decoder=True).num_attention_heads
    start = time.perf_counter()
    shapes = {(layer.num_heads, layer.key_dim, layer.value_dim) for layer in pool.layout.layers}
    if all([warm_up(heads, query_heads // heads, key_dim, value_dim, pool.dtype, model.device)
            for heads, key_dim, value_dim in sorted(shapes)]):
        logger.info("paged_flex: decode kernel ready in %.1f s", time.perf_counter() - start)
    # else the kernel logged why it did not compile, and decode steps gather as paged_sdpa's


def _speculative_option(options: argparse.Namespace, dtype: torch.dtype, model: Any) -> Any:
    """What the batcher's ``speculative=`` takes for ``--speculative``: its name, or the draft model loaded (its
    linear layers packed as the target's are, with ``--packed-linears``). Not given: ``"ngram"``, or ``"off"``
    (said in the log) for a model with conv / recurrent states, which cannot give back rejected drafts; asked
    for explicitly on such a model, the batcher refuses it with its reason."""
    from ..kinds import keeps_states

    choice = options.speculative
    if choice is None:
        if getattr(model.config, "is_encoder_decoder", False):
            logger.info("speculative decoding is off: %s is an encoder-decoder model", options.model)
            return "off"
        if keeps_states(model.config):
            logger.info("speculative decoding is off: %s has layers with conv / recurrent states, which cannot "
                        "give back rejected drafts", options.model)
            return "off"
        return "ngram"
    if not choice.startswith("draft:"):
        return choice
    name = choice[len("draft:"):]
    logger.info("loading the draft model %s (%s on %s)", name, dtype, options.device)
    draft = _load_model(options, dtype, name)[0]
    _pack_linears(draft, options, " of the draft model")
    return draft


def _pack_linears(model: Any, options: argparse.Namespace, whose: str) -> None:
    """Pack `model`'s linear layers for oneDNN as ``--packed-linears`` and ``--time-linears`` say (on a CPU)."""
    import torch

    from ..kernels import pack_linears, pack_timed, time_linear_shapes

    if not options.packed_linears or torch.device(options.device).type != "cpu":
        return
    if not options.time_linears:
        logger.info("packed %d linear layers%s for oneDNN", pack_linears(model), whose)
        return
    shapes = time_linear_shapes(model)
    for shape in shapes:
        logger.info("linear layers%s, %s", whose, shape.describe())
    logger.info("packed %d linear layers%s for oneDNN, those timed faster packed (from the rows they were)",
                pack_timed(model, shapes), whose)


def _load_model(options: argparse.Namespace, dtype: torch.dtype, name: str | None = None) -> tuple[Any, Any]:
    """The model `name` (default: ``--model``) and its tokenizer."""
    name = name or options.model
    if name in OFFLINE_MODELS:
        return load_model_and_tokenizer(OFFLINE_MODELS[name], device=options.device, dtype=dtype)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(name, trust_remote_code=options.trust_remote_code)
    loader = AutoModelForCausalLM
    if getattr(config, "is_encoder_decoder", False):  # the prompt is the encoder's input (Whisper: its audio)
        from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

        loader = AutoModelForSpeechSeq2Seq if hasattr(config, "num_mel_bins") else AutoModelForSeq2SeqLM
    elif hasattr(config, "vision_config"):  # an image-text model: chat messages may carry images
        from transformers import AutoModelForImageTextToText

        loader = AutoModelForImageTextToText
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=options.trust_remote_code)
    model = loader.from_pretrained(name, dtype=dtype, trust_remote_code=options.trust_remote_code)
    return model.to(options.device).eval(), tokenizer


def _log_pool(batcher: ContinuousBatcher) -> None:
    pool = batcher.pool
    for index, (group, blocks) in enumerate(zip(pool.layer_groups, pool.groups)):
        per_block = pool.group_bytes_per_block(index)
        if pool.is_elastic:
            logger.info("KV pool, %s: elastic (grows as needed), %s keys and values, blocks of %d tokens, %s B each",
                        group.name, pool.kv_format.description, pool.block_size, f"{per_block:,}")
        else:
            logger.info("KV pool, %s: %s blocks of %d tokens, %s keys and values, %s B each (%s B in all); holds %s "
                        "tokens", group.name, f"{blocks.capacity:,}", pool.block_size, pool.kv_format.description, f"{per_block:,}",
                        f"{blocks.capacity * per_block:,}", f"{blocks.capacity * pool.block_size:,}")
    if pool.layout.state_layers:
        slots = pool.states.ids
        logger.info("KV pool, sequence states of %d layers: %s", len(pool.layout.state_layers),
                    "elastic (grows as needed)" if slots.max_blocks is None else f"{slots.capacity:,} slots, one a request")


def server_settings(options: argparse.Namespace) -> ServerSettings:
    """The app's settings from this command's `options`."""
    from .http.settings import ServerSettings

    return ServerSettings(
        model_name=options.served_model_name or options.model, model_root=options.model, api_key=options.api_key,
        metrics_need_key=options.metrics_need_key, max_n=options.max_n, max_body_bytes=options.max_body_bytes,
        shutdown_grace=options.shutdown_grace, max_schema_bytes=options.max_schema_bytes,
        tool_call_parser=options.tool_call_parser, grammar_compile_timeout=options.grammar_compile_timeout,
    )
