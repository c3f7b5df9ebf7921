"""One run: send a scheduled list of requests to an endpoint and record each one.

Open loop (Poisson, burst, replay): each request is sent at its arrival offset whether or not
earlier ones have finished. Closed loop: `concurrency` clients each send their next request as
soon as their previous one ends. Both are bounded: nothing new is sent after `max_duration_s`,
and a request still running `request_timeout_s` after it was sent is cancelled as a timeout.
"""
from __future__ import annotations

import asyncio
import sys
import time

import httpx
from tqdm import tqdm

from benchmarks.load.client import ChatMessages, Endpoint, RequestRecord, send
from benchmarks.load.workload import RequestSpec

CONNECT_TIMEOUT_S = 10.0


async def run_requests(endpoint: Endpoint, specs: list[RequestSpec], prompts: dict[int, str], *,
                       concurrency: int | None, request_timeout_s: float, max_duration_s: float,
                       description: str = "", progress: bool = True,
                       transport: httpx.AsyncBaseTransport | None = None) -> list[RequestRecord]:
    """Send `specs` (with arrival offsets, or closed-loop when `concurrency` is set); one record each.

    `transport` replaces the network (tests pass an httpx.MockTransport).
    """
    records = [RequestRecord(s.index, s.num_input_tokens, s.num_output_tokens, s.arrival_s) for s in specs]
    bar = progress_bar(len(specs), description, progress)
    num_failed = 0

    async with open_client(endpoint, request_timeout_s, transport) as client:
        clock_zero = time.perf_counter()

        async def one(record: RequestRecord) -> None:
            nonlocal num_failed
            await send_within(client, endpoint, prompts[record.index], record, clock_zero, request_timeout_s)
            if not record.ok:
                num_failed += 1
                bar.set_postfix(failed=num_failed, refresh=False)
            bar.update()

        def out_of_time() -> bool:
            return time.perf_counter() - clock_zero > max_duration_s

        if concurrency is not None:
            queue = iter(records)

            async def client_loop() -> None:
                for record in queue:  # a shared iterator: each record goes to exactly one client
                    if out_of_time():
                        return
                    await one(record)

            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        else:
            tasks = []
            for record in records:
                delay = record.scheduled_s - (time.perf_counter() - clock_zero)
                if delay > 0:
                    await asyncio.sleep(delay)
                if out_of_time():
                    break
                tasks.append(asyncio.ensure_future(one(record)))
            await asyncio.gather(*tasks)
    bar.close()
    return records


def open_client(endpoint: Endpoint, request_timeout_s: float,
                transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """An async client for `endpoint` with no cap on connections (the load decides how many)."""
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=endpoint.base_url, timeout=timeout, limits=limits, transport=transport)


async def send_within(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str | ChatMessages,
                      record: RequestRecord, clock_zero: float, request_timeout_s: float) -> None:
    """`send`, cancelled as a timeout when still running `request_timeout_s` after it was sent."""
    try:
        await asyncio.wait_for(send(client, endpoint, prompt, record, clock_zero), request_timeout_s)
    except asyncio.TimeoutError:
        record.error, record.error_message = "timeout", f"still running after {request_timeout_s:g} s"
        record.end_s = time.perf_counter() - clock_zero


def progress_bar(total: int, description: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="req", file=sys.stderr, disable=not enabled, dynamic_ncols=True)
