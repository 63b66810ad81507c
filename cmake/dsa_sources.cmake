# Sources of the dsa library. A new op adds src/ops/<op>.cpp,
# src/reference/<op>.cpp and src/cpu/<op>/; nothing here needs editing.
# Files named *_avx2.cpp, *_avx512.cpp, *_avx512bf16.cpp or *_amx.cpp are compiled for that ISA
# only and are called only after run-time detection picked it.
file(GLOB DSA_SOURCES CONFIGURE_DEPENDS
  ${CMAKE_CURRENT_SOURCE_DIR}/src/core/*.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/ops/*.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/reference/*.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu/*/*.cpp)

set(DSA_AVX2_FLAGS -mavx2 -mfma -mf16c)
set(DSA_AVX512_FLAGS ${DSA_AVX2_FLAGS} -mavx512f -mavx512bw -mavx512vl -mavx512dq -mprefer-vector-width=512)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  # GCC 12's own avx512fintrin.h starts its "undefined" vectors as `__m512 __Y = __Y;`,
  # which -W(maybe-)uninitialized reports at every inlined use (GCC bug 105593, fixed in
  # 13): ~330 warnings about the compiler's header in a release build, hiding any real
  # one. Off for the AVX-512 files only; the kernels' shared headers keep the warnings in
  # their AVX2 and portable builds.
  list(APPEND DSA_AVX512_FLAGS -Wno-maybe-uninitialized -Wno-uninitialized)
endif()
set(DSA_AVX512BF16_FLAGS ${DSA_AVX512_FLAGS} -mavx512bf16)
set(DSA_AMX_FLAGS ${DSA_AVX512BF16_FLAGS} -mamx-tile -mamx-bf16)
foreach(src IN LISTS DSA_SOURCES)
  if(src MATCHES "_amx\\.cpp$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${DSA_AMX_FLAGS}")
  elseif(src MATCHES "_avx512bf16\\.cpp$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${DSA_AVX512BF16_FLAGS}")
  elseif(src MATCHES "_avx512\\.cpp$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${DSA_AVX512_FLAGS}")
  elseif(src MATCHES "_avx2\\.cpp$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${DSA_AVX2_FLAGS}")
  endif()
endforeach()
