# What `cmake --install` puts under the prefix, so that a C++ program can
#   find_package(kvcd 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE kvcd::client)
# (component dev: the client library, the static libraries it links, their headers and the
# package config; component bin: kvcd and kvctl). tests/install/ checks it end to end.
set(kvcd_client_libs kvcd_client kvcd_proto kvcd_wire kvcd_common kvcd_kernels kvcd_flags)
set_target_properties(kvcd_client PROPERTIES EXPORT_NAME client)
set_target_properties(kvcd_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(kvcd_wire PROPERTIES EXPORT_NAME wire)
set_target_properties(kvcd_common PROPERTIES EXPORT_NAME common)
set_target_properties(kvcd_kernels PROPERTIES EXPORT_NAME kernels)
set_target_properties(kvcd_flags PROPERTIES EXPORT_NAME flags)
install(TARGETS ${kvcd_client_libs} EXPORT kvcdTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
        INCLUDES DESTINATION ${KVCD_INSTALL_INCLUDEDIR})
install(TARGETS kvcd kvctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT bin)

# Headers, as the sources include them: client/, common/, proto/ (the wire helpers and the
# generated kvcd/v1 and grpc/health/v1 code), kvcd/kernels/.
foreach(dir client common proto)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/ DESTINATION ${KVCD_INSTALL_INCLUDEDIR}/${dir}
          COMPONENT dev FILES_MATCHING PATTERN "*.h"
          PATTERN "python" EXCLUDE PATTERN "workers" EXCLUDE PATTERN "kvcd" EXCLUDE
          PATTERN "grpc" EXCLUDE)
endforeach()
install(DIRECTORY ${PROJECT_BINARY_DIR}/proto/gen/ DESTINATION ${KVCD_INSTALL_INCLUDEDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.h")
install(DIRECTORY ${PROJECT_SOURCE_DIR}/kernels/include/ DESTINATION ${KVCD_INSTALL_INCLUDEDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.h")

include(CMakePackageConfigHelpers)
set(kvcd_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/kvcd)
install(EXPORT kvcdTargets NAMESPACE kvcd:: DESTINATION ${kvcd_cmake_dir} COMPONENT dev)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvcdConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kvcdConfig.cmake INSTALL_DESTINATION ${kvcd_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvcdConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvcdConfig.cmake ${PROJECT_BINARY_DIR}/kvcdConfigVersion.cmake
        DESTINATION ${kvcd_cmake_dir} COMPONENT dev)
