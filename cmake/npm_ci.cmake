# Installs the report's charting library from report/package-lock.json with
# `npm ci` into a build folder, so the binary embeds exactly the locked version.
# Usage: cmake -DNPM=npm -DSRC=report -DDIR=build/report_node -DSTAMP=file [-DINSTALLED=dir] -P npm_ci.cmake
file(MAKE_DIRECTORY ${DIR})
# Machines without registry access (GPU nodes) can take the package from
# report/node_modules, installed by `npm ci` in report/ on a connected
# machine and copied over, when its version is the locked one.
file(READ ${SRC}/package-lock.json lock)
string(JSON locked GET "${lock}" packages node_modules/uplot version)
# INSTALLED, when given, is another build's folder (what build/sanitize takes
# from the main build), tried the same way.
foreach(from ${SRC} ${INSTALLED})
  if(NOT EXISTS ${from}/node_modules/uplot/package.json)
    continue()
  endif()
  file(READ ${from}/node_modules/uplot/package.json installed_json)
  string(JSON installed GET "${installed_json}" version)
  if(installed STREQUAL locked)
    file(REMOVE_RECURSE ${DIR}/node_modules)
    file(COPY ${from}/node_modules DESTINATION ${DIR})
    file(TOUCH ${STAMP})
    return()
  endif()
  message(WARNING "pacer report: ${from}/node_modules holds uplot ${installed}, the lock says ${locked}; running npm ci")
endforeach()
set(WHAT "pacer report")
set(HINT "Or run `npm ci` in report/ on a connected machine and copy report/node_modules here.")
include(${CMAKE_CURRENT_LIST_DIR}/npm_ci_dir.cmake)
