// Test-only shim: the CUDA API as emulated on the CPU by the harness.
#pragma once
#include "cuda_on_cpu.h"
#include "tensor_map_emulation.h"
