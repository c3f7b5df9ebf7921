"""`python -m server.healthcheck`: exit 0 when the `tandem serve` on this host answers GET /health
with 200, else 1 with the reason on stderr. The container images' HEALTHCHECK; the port is
$TANDEM_PORT's (the images set it), else 8000. Standard library only, so a probe costs little."""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from typing import Mapping

DEFAULT_PORT = 8000
TIMEOUT_S = 5.0


def health_url(environ: Mapping[str, str]) -> str:
    return f"http://127.0.0.1:{environ.get('TANDEM_PORT', DEFAULT_PORT)}/health"


def check(url: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """None when `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"status {response.status}"
    except urllib.error.HTTPError as exc:  # 503 while the engine is not running
        return f"status {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def main() -> int:
    url = health_url(os.environ)
    problem = check(url)
    if problem is not None:
        print(f"unhealthy: {url}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
