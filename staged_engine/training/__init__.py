"""Training of the embedded demo pair: corpus, tokenizer, models. Never imported by the runtime."""
