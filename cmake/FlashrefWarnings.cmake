# flashref_warnings(target): the warning set for flashref's own targets (never for dependencies).
function(flashref_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${FLASHREF_WERROR}>>:-Werror>
    # GCC 12 reports -Wrestrict on "literal" + std::string at -O3 (GCC bug 105329), a false
    # positive inside libstdc++: kept a warning, never an error, so a Release build cannot fail
    # on it.
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>,$<BOOL:${FLASHREF_WERROR}>>:-Wno-error=restrict>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${FLASHREF_WERROR}>>:-Werror=all-warnings>)
endfunction()
