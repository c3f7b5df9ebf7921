"""Cost tables for engine tests of CPU offloading: plans that take the offloading paths often."""
import json


def cost_tables(num_layers: int) -> dict:
    """Per-layer seconds: linear work flat in tokens (weight reads dominate), cheap CPU attention."""
    return {
        "num_layers": num_layers,
        "linear": [[1, 1e-3], [64, 1.05e-3], [2048, 4e-3]],
        "prefill_attention": [[1, 1e-6], [2048, 1e-3]],
        "gpu_decode_attention": [[1, 1e-7], [100000, 1e-3]],
        "cpu_decode_attention": {"xs": [1, 64], "ys": [1, 100000], "zs": [[1e-6, 2e-3], [2e-6, 2e-3]]},
        "head": [[1, 1e-4], [64, 2e-4]],
        "swap_per_block": 1e-6,
    }


def write_cost_tables(tmp_path, num_layers):
    tables = tmp_path / "costs.json"
    tables.write_text(json.dumps(cost_tables(num_layers)))
    return str(tables)
