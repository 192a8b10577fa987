"""The generation endpoints' logic, in the order a request meets it: ``prepare`` (body, model,
readiness), ``jobs.build`` (tokens, lengths, one request per choice: ``router.jobs``), ``run``
(admission, the ``router`` span, every choice's stream from the PD client at once, the first token),
then the body as JSON (``router.json_response``) or as SSE (``router.sse_response``).

A streaming response starts only once the first token has arrived, so failures before it still get
their status code (``router.errors.api_error``). Generation responses carry
``x-pdserve-decode-worker``: the decode worker that produced the first token.
"""

from __future__ import annotations

import time

from fastapi import Request
from starlette.responses import Response

from engine.tokenizer import Tokenizer
from router.admission import AdmissionGate
from router.client import PDClient
from router.config import RouterConfig
from router.errors import api_error, model_not_found, unavailable
from router.http import SSEResponse, read_body
from router.jobs import Job, JobBuilder
from router.json_response import json_response
from router.metrics import RouterMetrics
from router.protocol import CompletionParams, check_common, decode_body
from router.sse_response import sse_events
from router.streaming import merge_choices
from router.telemetry import RequestTelemetry
from telemetry.tracing import Tracing

DECODE_WORKER_HEADER = "x-pdserve-decode-worker"


class Generation:
    def __init__(self, client: PDClient, tokenizer: Tokenizer, config: RouterConfig, tracer: Tracing) -> None:
        self.client = client
        self.config = config
        self.tracer = tracer
        self.jobs = JobBuilder(config, tokenizer)
        self.gate = AdmissionGate(config.max_queued_requests, config.max_queued_tokens)
        self.metrics = RouterMetrics(self.gate, config.model_name)

    async def prepare(self, request: Request, type_: type[CompletionParams]) -> CompletionParams:
        config = self.config
        req = decode_body(await read_body(request, config.max_request_bytes), type_)
        check_common(req)
        if req.model != config.model_name:
            raise model_not_found(req.model)
        if not self.client.is_ready():
            raise unavailable("The server is starting; retry shortly.", code="not_ready")
        return req

    async def run(self, job: Job, request: Request) -> Response:
        config = self.config
        ticket = self.gate.admit(sum(len(p) for p in job.prompts) * job.req.choices)
        admitted = time.monotonic()
        tel = RequestTelemetry(self.tracer, self.metrics, request.headers, job.chat, config.model_name,
                               job.requests, job.envelope.id)
        job.requests = tel.stamp(job.requests)
        deltas = merge_choices([self.client.generate(r) for r in job.requests], job.decoders,
                               admitted + config.request_timeout, request.is_disconnected)
        try:
            first = await anext(deltas)
        except BaseException as exc:
            ticket.release()
            await deltas.aclose()
            job.finish(tel, exc)
            raise api_error(exc, config.request_timeout) from None
        ticket.started()
        tel.first_token()
        self.metrics.ttft.labels(request.url.path).observe(time.monotonic() - admitted)
        worker = {DECODE_WORKER_HEADER: job.decoders[first.index].worker_id}
        if job.req.streaming:
            events = sse_events(job, first, deltas, ticket, tel, self.metrics, config.request_timeout)
            return SSEResponse(events, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **worker})
        with ticket:
            return await json_response(job, first, deltas, tel, worker, self.metrics, config.request_timeout)
