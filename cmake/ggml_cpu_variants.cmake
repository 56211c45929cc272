# ggml_cpu_variants.cmake — builds only what trioserve needs of llama.cpp: some of its
# run-time-selected CPU variants, and no `common` library.
#
# llama-cpp-python compiles llama.cpp from its sdist; with GGML_CPU_ALL_VARIANTS=ON that is
# fourteen copies of the CPU kernels (x64 ... sapphirerapids), most of which the machine that
# builds them cannot run. scripts/llama_cmake_args.py passes this file as CMAKE_PROJECT_INCLUDE
# (CMake includes it after every project() call) with TRIOSERVE_GGML_CPU_VARIANTS, the
# comma-separated variants to keep (this machine's best, the next one down, the portable x64).
# ggml exposes no option for a subset, so the hook replaces ggml's
# ggml_add_cpu_backend_variant_impl (defined by ggml-cpu/CMakeLists.txt) with a filter the first
# time a variant is added, i.e. after ggml defined it and before it is called: the watch on
# GGML_CPU_TAG_NAME, which ggml_add_cpu_backend_variant sets right before the call. CMake keeps
# the replaced definition as _ggml_add_cpu_backend_variant_impl. A variant name ggml does not
# add is a configure error, as is a ggml that never sets GGML_CPU_TAG_NAME (then this hook no
# longer fits the bundled ggml and must be revised).
# CMAKE_ARGS reach every CMake project pip builds in the same command (trioserve's own workers,
# the ExecuTorch worker): this hook acts only inside llama-cpp-python's (top-level `llama_cpp`).
if(NOT CMAKE_PROJECT_NAME STREQUAL "llama_cpp")
  return()
endif()

# llama-cpp-python forces LLAMA_BUILD_COMMON on, for its multimodal library (LLAVA_BUILD), which
# trioserve neither builds nor uses: without it llama.cpp's `common` library (51 of the build's
# heaviest files) is dead weight. Turned off when llama.cpp's own project() is entered, after
# llama-cpp-python forced it.
if(PROJECT_NAME STREQUAL "llama.cpp" AND DEFINED LLAVA_BUILD AND NOT LLAVA_BUILD)
  set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)
endif()

if(NOT DEFINED TRIOSERVE_GGML_CPU_VARIANTS OR TRIOSERVE_GGML_CPU_VARIANTS STREQUAL "all")
  return()
endif()
if(COMMAND _trioserve_cpu_variant_watch)  # included after every project(): install once
  return()
endif()

string(REPLACE "," ";" _trioserve_keep "${TRIOSERVE_GGML_CPU_VARIANTS}")
set_property(GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_KEEP "${_trioserve_keep}")
set_property(GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_SEEN "")
set_property(GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_BUILT "")

function(_trioserve_cpu_variant_watch variable access value)
  if(NOT access STREQUAL "MODIFIED_ACCESS" OR COMMAND _trioserve_cpu_variant_filter_installed)
    return()
  endif()
  if(NOT COMMAND ggml_add_cpu_backend_variant_impl)
    message(FATAL_ERROR "trioserve: ggml_add_cpu_backend_variant_impl is not defined when the first CPU "
                        "variant is added: cmake/ggml_cpu_variants.cmake no longer fits this ggml")
  endif()
  function(_trioserve_cpu_variant_filter_installed)
  endfunction()
  function(ggml_add_cpu_backend_variant_impl tag_name)
    get_property(keep GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_KEEP)
    set_property(GLOBAL APPEND PROPERTY TRIOSERVE_CPU_VARIANTS_SEEN "${tag_name}")
    if(tag_name IN_LIST keep)
      set_property(GLOBAL APPEND PROPERTY TRIOSERVE_CPU_VARIANTS_BUILT "${tag_name}")
      _ggml_add_cpu_backend_variant_impl(${tag_name})
    else()
      message(STATUS "trioserve: CPU variant ${tag_name} not built (TRIOSERVE_GGML_CPU_VARIANTS)")
    endif()
  endfunction()
endfunction()
variable_watch(GGML_CPU_TAG_NAME _trioserve_cpu_variant_watch)

# At the end of the top-level directory: every requested variant was added.
function(_trioserve_cpu_variants_check)
  get_property(keep GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_KEEP)
  get_property(seen GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_SEEN)
  get_property(built GLOBAL PROPERTY TRIOSERVE_CPU_VARIANTS_BUILT)
  if(NOT seen)
    message(FATAL_ERROR "trioserve: TRIOSERVE_GGML_CPU_VARIANTS is set but ggml added no CPU variant through "
                        "ggml_add_cpu_backend_variant_impl (is GGML_CPU_ALL_VARIANTS=ON?)")
  endif()
  foreach(v IN LISTS keep)
    if(NOT v IN_LIST seen)
      message(FATAL_ERROR "trioserve: CPU variant '${v}' is not one ggml builds here (it builds: ${seen})")
    endif()
  endforeach()
  message(STATUS "trioserve: CPU variants built: ${built} (of ${seen})")
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _trioserve_cpu_variants_check)
