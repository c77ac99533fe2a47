"""uvicorn stopping as routers expect of a replica: on SIGTERM (or Ctrl-C) the server drains, /health
answers 503 and new generation requests 503 with Retry-After (a router sends them to another replica),
while the requests in flight run to their end; it exits once none is left. A second signal stops it at
once."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from .openai_server import OpenAIServer

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: OpenAIServer) -> None:
        super().__init__(config)
        self.openai_server = server

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.openai_server.draining:
            super().handle_exit(sig, frame)
            return
        self.openai_server.draining = True
        logger.info(
            "Draining: %d sequences in flight finish, new requests get 503; signal again to stop at once.",
            self.openai_server.in_flight,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.openai_server.draining and self.openai_server.in_flight == 0:
            self.should_exit = True
        return await super().on_tick(counter)
