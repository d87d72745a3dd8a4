"""vLLM's tokenizer endpoints: /tokenize (a prompt or chat messages to token ids), /detokenize
and /tokenizer_info."""

from __future__ import annotations

import asyncio
from typing import Any

from jpaged.server.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from jpaged.server.serving import Serving


class TokenizationServing(Serving):
    """The handlers of /tokenize, /detokenize and /tokenizer_info (no engine step runs)."""

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """The token ids of a prompt, or of chat messages rendered as a chat request would be
        (the same ids /v1/chat/completions runs), with the count and max_model_len."""
        self.check_model(req.model)
        req.check()
        text = req.prompt if req.messages is None else self.chat_text(req)
        assert text is not None
        tok, special = self.engine.tokenizer, req.special_tokens
        ids = await asyncio.get_running_loop().run_in_executor(
            None, lambda: tok.encode(text, add_special_tokens=special))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """The text of token ids, special tokens kept (vLLM's /detokenize); an id outside the
        tokenizer's vocabulary is a 400 naming its position."""
        self.check_model(req.model)
        tok = self.engine.tokenizer
        n = tok.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < n:
                raise OpenAIError(400, f"tokens[{i}] is {t}, not a token id of this model's "
                                  f"tokenizer (0 to {n - 1})", param="tokens")
        ids = list(req.tokens)
        text = await asyncio.get_running_loop().run_in_executor(
            None, lambda: tok.decode(ids, skip_special_tokens=False))
        return {"prompt": text}

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's special tokens, added tokens, chat template and the served context
        length (vLLM's /tokenizer_info, which a server opts into)."""
        tok = self.engine.tokenizer
        added = {str(i): {"content": t.content, "special": t.special,
                          "single_word": t.single_word, "lstrip": t.lstrip, "rstrip": t.rstrip,
                          "normalized": t.normalized}
                 for i, t in sorted(tok.backend.get_added_tokens_decoder().items())}
        return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token,
                "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                "unk_token": tok.unk_token,
                "chat_template": self.chat_template or tok.chat_template,
                "model_max_length": self.engine.max_model_len, "vocab_size": tok.vocab_size,
                "added_tokens_decoder": added}
