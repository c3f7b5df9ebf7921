"""tandem's benchmarks, one package: every benchmark is a module run from the repository root as
`python -m benchmarks.<group>.<name>` (or `tandem bench <name>`), its results written to
benchmarks/results/ (report.py) and its table put in docs/benchmarks.md (update_benchmarks_doc.py).
load/ is the HTTP load generator; serving/, kernels/, offload/, gpu/ and simulation/ group the rest
by what they measure."""
import kernels  # noqa: F401  before any benchmark imports torch: it caps torch's OpenMP spinning
