"""The router's typed configuration; defaults live here and nowhere else."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class RouterConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535, description="Port clients call.")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Largest request body accepted (413 above), bytes.")
    refresh_interval_s: float = Field(0.5, gt=0, description="How often discovery re-reads replicas, tokens, specs.")
    unknown_token_reread_s: float = Field(0.5, gt=0, description="A request whose token the table lacks waits for a "
                                          "read that began after it arrived (a token created a moment ago works); "
                                          "such reads begin at most once per this many seconds, and a token a read "
                                          "found unknown is answered 401 at once for a minute, so bad tokens cost the "
                                          "database no more than the periodic refresh.")
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect to a replica.")
    request_timeout_s: float = Field(300.0, gt=0, description="Whole upstream request, first byte to last.")
    max_attempts: int = Field(3, ge=1, description="Tries per request over distinct replicas; only connect failures "
                                                   "are retried, never a request a replica may have received.")
    retry_after_s: int = Field(5, ge=1, description="Retry-After sent with 503 when no replica is ready.")
    max_response_bytes: int = Field(64 << 20, gt=0, description="Largest non-streamed answer relayed (502 above), "
                                                              "bytes.")
    keepalive_timeout_s: float = Field(2.0, gt=0, description="Idle connections to replicas are closed after this, "
                                       "before the replica's own keep-alive (5 s for uvicorn) can close them under a "
                                       "request.")
    max_waiting_per_endpoint: int = Field(256, ge=0, description="Requests held for an endpoint with no ready replica "
                                          "(scale from zero); more get 503 at once.")
    hold_cold_start_factor: float = Field(2.0, gt=0, description="A held request waits up to this × the revision's "
                                          "measured cold start, plus hold_margin_s.")
    hold_margin_s: float = Field(5.0, ge=0, description="Added to the scaled cold start, seconds.")
    hold_min_s: float = Field(10.0, ge=0, description="Shortest hold deadline, seconds.")
    hold_max_s: float = Field(180.0, gt=0, description="Longest hold deadline (and the deadline when the cold start "
                                                       "was never measured), seconds.")
    max_json_depth: int = Field(32, ge=2, le=512, description="Deepest nesting of a request body (400 above).")
    max_choices: int = Field(8, ge=1, description="Largest n and best_of of an LLM request.")
    max_logprobs: int = Field(20, ge=0, description="Largest logprobs, top_logprobs and prompt_logprobs.")
    max_shadow_in_flight: int = Field(64, ge=0, description="Shadow copies in flight at once; more are not sent "
                                      "(counted in modelplane_router_shadow_dropped).")
    log_buffer_records: int = Field(10_000, ge=1, description="Inference-log records held for the database writer; "
                                    "more are dropped and counted, never waited for.")
    log_prune_interval_s: float = Field(600.0, gt=0, description="How often the inference log's old records are "
                                        "deleted (each endpoint's inference_log.retention_days).")
    default_context_tokens: int = Field(32768, ge=1, description="Bound on max_tokens when the serving revision does "
                                                                 "not record its model's context length, tokens.")

    def limits(self):
        from serving.router.limits import RequestLimits

        return RequestLimits(max_json_depth=self.max_json_depth, max_choices=self.max_choices,
                             max_logprobs=self.max_logprobs, default_context_tokens=self.default_context_tokens)

    @model_validator(mode="after")
    def _timeouts_ordered(self) -> "RouterConfig":
        if self.connect_timeout_s > self.request_timeout_s:
            raise ValueError("connect_timeout_s must not exceed request_timeout_s")
        if self.hold_min_s > self.hold_max_s:
            raise ValueError("hold_min_s must not exceed hold_max_s")
        return self
