"""`generate`'s modes, each as the keyword arguments that select it: the cases every cache must get right."""

MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3),
    "beam_search": dict(num_beams=4, length_penalty=1.3, early_stopping=True, num_return_sequences=2),
    "beam_sampling": dict(num_beams=3, do_sample=True),
    "logits_processors": dict(do_sample=False, repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=25),
    "prefix_allowed_tokens_fn": dict(
        do_sample=False, prefix_allowed_tokens_fn=lambda row, ids: [int(ids[-1]) % 40 + 3, int(ids[-1]) % 7 + 50]
    ),
}
