"""flowgrpo's benchmarks: `just bench` (`python -m benchmarks`) runs them all on the CPU.

Each compares a flowgrpo stage with the least work that produces the same result, side by side
in one process, on the built-in tiny SD3 model:

1. rollout   the rollout stage vs the plain diffusers pipeline call making the same images
             (and vs that call on the LoRA-wrapped transformer), with a breakdown of the parts;
             PNG encoding of a 512x512 image at Pillow's default level vs level 1
2. update    the update stage vs the bare LoRA forward + backward of the same micro-batches,
             with a breakdown; the adapter off/on switch around each reference forward
3. memory    the update's peak memory at 1x and 8x the samples per iteration, in fresh processes
4. loop      `flowgrpo loop` vs the same stages run as separate commands, and each stage's share
5. arrow     writing / reading a rollout part as Arrow vs copying / reading a plain file
6. ocr       OCR reward throughput (images/s) with 1 and 2 worker processes
7. algorithms nft's rollout vs flow_grpo's, and MixGRPO-Flash's solver vs Euler
8. plan      `flowgrpo plan`'s predicted peak memory of rollout and update vs the measured peak,
             on an SD3.5-Medium-wide transformer of 4 blocks (0.27B parameters), in a fresh process

Results go to the console and to benchmarks/results.md (with the date and the machine).
"""
