"""`python -m ppo_fabric.export checkpoint=PATH format=torchscript|onnx`: see `ppo_fabric.policy.export`."""

from ppo_fabric.policy.export import main

if __name__ == "__main__":
    main()
