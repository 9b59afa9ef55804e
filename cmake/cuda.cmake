# CUDA kernels (cuda/) and the _jaxops_cuda module (xla_ffi/cuda/), built when
# nvcc is found (CMAKE_CUDA_COMPILER, CUDACXX or PATH); otherwise the build is
# CPU-only. cudart is linked statically and loads the driver only when a kernel
# runs, so the module imports on machines without a GPU or driver.
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "jaxops: nvcc not found, building the CPU kernels only")
  return()
endif()

set(JAXOPS_CUDA_ARCHITECTURES "80;90" CACHE STRING
    "GPU architectures of the CUDA kernels, in CMAKE_CUDA_ARCHITECTURES syntax")
option(JAXOPS_CUDA_RESOURCE_USAGE
       "Print the registers and shared memory ptxas gives every kernel" OFF)
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES ${JAXOPS_CUDA_ARCHITECTURES})
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
message(STATUS
  "jaxops: CUDA ${CUDAToolkit_VERSION} kernels for architectures ${JAXOPS_CUDA_ARCHITECTURES}")

# CUDA kernels: no XLA, no Python. A register spill or any other warning is an
# error: the kernels are tuned to fit in registers on every shipped architecture.
file(GLOB JAXOPS_CUDA_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/cuda/*.cu")
# The sm_90a kernels (wgmma, setmaxnreg: FlashAttention-3, issue 42) exist only
# for the architecture-specific target sm_90a. By default they compile with the
# rest, for JAXOPS_CUDA_ARCHITECTURES, where their kernel bodies are traps (and
# nothing dispatches to them yet). With JAXOPS_CUDA_SM90A=ON and 90 among the
# architectures their sources build apart for "90a-real" and join the library.
# Such a build defines JAXOPS_CUDA_HAS_SM90A for cuda/attention.cu, whose
# dispatch then sends an sm_90 device's supported forward calls to the FA3
# kernel when JAXOPS_CUDA_ATTENTION_FA3=1. Off by default, and the kernel
# opt-in, until a GPU has run it (docs/cuda.md).
option(JAXOPS_CUDA_SM90A "Build the sm_90a (FlashAttention-3) kernels for 90a-real" OFF)
set(JAXOPS_CUDA_SM90A_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/cuda/attention_forward_sm90.cu")
set(JAXOPS_CUDA_OPTIONS
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror
    -Xptxas=-warn-spills,-warn-lmem-usage,-Werror>)
if(JAXOPS_CUDA_SM90A AND JAXOPS_CUDA_ARCHITECTURES MATCHES "(^|;)90[-a-z]*(;|$)")
  list(REMOVE_ITEM JAXOPS_CUDA_SOURCES ${JAXOPS_CUDA_SM90A_SOURCES})
  add_library(jaxops_cuda_sm90a OBJECT ${JAXOPS_CUDA_SM90A_SOURCES})
  set_target_properties(jaxops_cuda_sm90a PROPERTIES
    CUDA_ARCHITECTURES "90a-real"
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON)
  target_include_directories(jaxops_cuda_sm90a PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  target_link_libraries(jaxops_cuda_sm90a PRIVATE CUDA::cudart_static)
  target_compile_options(jaxops_cuda_sm90a PRIVATE ${JAXOPS_CUDA_OPTIONS})
  if(JAXOPS_CUDA_RESOURCE_USAGE)
    target_compile_options(jaxops_cuda_sm90a PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
  endif()
  list(APPEND JAXOPS_CUDA_SOURCES $<TARGET_OBJECTS:jaxops_cuda_sm90a>)
  set(JAXOPS_CUDA_HAS_SM90A ON)
endif()
add_library(jaxops_cuda_kernels STATIC ${JAXOPS_CUDA_SOURCES})
set_target_properties(jaxops_cuda_kernels PROPERTIES
  CUDA_ARCHITECTURES "${JAXOPS_CUDA_ARCHITECTURES}"
  CUDA_RUNTIME_LIBRARY Static
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON)
target_include_directories(jaxops_cuda_kernels PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}")
target_link_libraries(jaxops_cuda_kernels PUBLIC CUDA::cudart_static)
target_compile_options(jaxops_cuda_kernels PRIVATE ${JAXOPS_CUDA_OPTIONS})
if(JAXOPS_CUDA_HAS_SM90A)
  target_compile_definitions(jaxops_cuda_kernels PRIVATE JAXOPS_CUDA_HAS_SM90A=1)
endif()
if(JAXOPS_CUDA_RESOURCE_USAGE)
  target_compile_options(jaxops_cuda_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endif()

# The resource table: registers, static shared memory, stack and local memory of
# every kernel for every architecture, read back from the built library by
# cuobjdump and printed after each (re)build of it. It is also installed as
# jaxops/cuda_resource_usage.txt, which the test suite prints in its summary, so
# the CI log shows it (pip shows build output only with -v). cuobjdump and
# nvdisasm: the toolkit's, else the ones from PyPI's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm (build requirements).
# The toolkit's binary `name`, else the one the PyPI wheel `wheel` installed, in `out`.
function(jaxops_find_cuda_tool out name wheel)
  find_program(tool ${name} HINTS "${CUDAToolkit_BIN_DIR}" NO_CACHE)
  if(NOT tool)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "
import importlib.metadata as metadata
try:
    files = metadata.files('${wheel}') or []
except metadata.PackageNotFoundError:
    files = []
print(next((str(f.locate()) for f in files if f.name == '${name}'), ''), end='')
"
      OUTPUT_VARIABLE tool ERROR_QUIET)
  endif()
  set(${out} "${tool}" PARENT_SCOPE)
endfunction()
jaxops_find_cuda_tool(JAXOPS_CUOBJDUMP cuobjdump nvidia-cuda-cuobjdump)
# cuobjdump -sass disassembles through nvdisasm (on PATH).
jaxops_find_cuda_tool(JAXOPS_NVDISASM nvdisasm nvidia-cuda-nvdisasm)
if(JAXOPS_CUOBJDUMP)
  message(STATUS "jaxops: CUDA resource table by ${JAXOPS_CUOBJDUMP}")
  set(JAXOPS_CUDA_RESOURCE_TABLE "${CMAKE_CURRENT_BINARY_DIR}/cuda_resource_usage.txt")
  add_custom_command(TARGET jaxops_cuda_kernels POST_BUILD
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/cuda_resource_table.py"
            "${JAXOPS_CUOBJDUMP}" "$<TARGET_FILE:jaxops_cuda_kernels>" "${JAXOPS_CUDA_RESOURCE_TABLE}"
    VERBATIM)
  # The SASS instruction summary (HMMA, LDSM, LDGSTS... per kernel), next to
  # the table and installed with it; tests/test_cuda_sass.py gates on it.
  if(JAXOPS_NVDISASM)
    get_filename_component(JAXOPS_NVDISASM_DIR "${JAXOPS_NVDISASM}" DIRECTORY)
    set(JAXOPS_CUDA_SASS_SUMMARY "${CMAKE_CURRENT_BINARY_DIR}/cuda_sass_summary.txt")
    add_custom_command(TARGET jaxops_cuda_kernels POST_BUILD
      COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/cuda_sass_summary.py"
              "${JAXOPS_CUOBJDUMP}" "${JAXOPS_NVDISASM_DIR}" "$<TARGET_FILE:jaxops_cuda_kernels>"
              "${JAXOPS_CUDA_SASS_SUMMARY}"
      VERBATIM)
  else()
    message(STATUS "jaxops: no nvdisasm (CUDA toolkit or pip nvidia-cuda-nvdisasm), no SASS summary")
  endif()
else()
  message(STATUS "jaxops: no cuobjdump (CUDA toolkit or pip nvidia-cuda-cuobjdump), no CUDA resource table")
endif()

# FFI handlers for CUDA: the same targets as the CPU module, registered for
# platform "CUDA" by jaxops/_src/ffi_targets.py.
file(GLOB JAXOPS_CUDA_HANDLERS CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cuda/*.cc")
nanobind_add_module(_jaxops_cuda NB_STATIC
  "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/python_module.cc" ${JAXOPS_CUDA_HANDLERS})
target_include_directories(_jaxops_cuda SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
target_include_directories(_jaxops_cuda PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
target_compile_definitions(_jaxops_cuda PRIVATE
  JAXOPS_MODULE_NAME=_jaxops_cuda JAXOPS_PLATFORM_CUDA)
target_link_libraries(_jaxops_cuda PRIVATE jaxops_cuda_kernels CUDA::cudart_static)

if(SKBUILD)
  install(TARGETS _jaxops_cuda LIBRARY DESTINATION jaxops)
  if(JAXOPS_CUOBJDUMP)
    # OPTIONAL: a build directory whose library predates the table has none yet.
    install(FILES "${JAXOPS_CUDA_RESOURCE_TABLE}" DESTINATION jaxops OPTIONAL)
  endif()
  if(JAXOPS_CUDA_SASS_SUMMARY)
    install(FILES "${JAXOPS_CUDA_SASS_SUMMARY}" DESTINATION jaxops OPTIONAL)
  endif()
else()
  set_target_properties(_jaxops_cuda PROPERTIES
    LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/jaxops")
endif()
