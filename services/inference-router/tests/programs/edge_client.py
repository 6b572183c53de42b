"""A client at an edge site: ``edge_client.py TARGET MODEL COUNT PREFIX TOKEN`` sends COUNT requests
(request ids PREFIX-0 ..) to the host agent's KServe front and prints one JSON line:
``{"ok": n, "failed": [[request_id, error], ..]}``. Run inside the site's network namespace."""

import json
import sys

import numpy as np
import tritonclient.grpc as triton


def main() -> None:
    target, model, count, prefix, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    ok, failed = 0, []
    data = np.ones((1, 16), np.float32)
    with triton.InferenceServerClient(target) as client:
        for index in range(count):
            tensor = triton.InferInput("features", [1, 16], "FP32")
            tensor.set_data_from_numpy(data)
            try:
                client.infer(model, [tensor], request_id=f"{prefix}-{index}", client_timeout=10.0,
                             headers={"authorization": f"Bearer {token}"})
                ok += 1
            except Exception as error:  # noqa: BLE001 - every failure is reported
                failed.append([f"{prefix}-{index}", str(error)])
    print(json.dumps({"ok": ok, "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
