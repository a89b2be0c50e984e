# Writes a C++ file defining kvcd::kConfigSchemaJson, the text of the config schema, so that
# the daemon validates configs against the very file the Helm chart's schema is derived from.
#   cmake -DIN=kvcd-config.schema.json -DOUT=config_schema_text.cc -P embed_schema.cmake
file(READ "${IN}" text)
string(FIND "${text}" ")kvcdschema\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string delimiter )kvcdschema\"")
endif()
file(WRITE "${OUT}.tmp"
  "// Generated from server/config/kvcd-config.schema.json by embed_schema.cmake.\n"
  "namespace kvcd {\n"
  "extern const char kConfigSchemaJson[];\n"
  "const char kConfigSchemaJson[] = R\"kvcdschema(${text})kvcdschema\";\n"
  "}  // namespace kvcd\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUT}.tmp" "${OUT}")
file(REMOVE "${OUT}.tmp")
