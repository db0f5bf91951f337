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
if(NOT NPM)
  message(FATAL_ERROR "pacer report: npm not found; run scripts/deps.sh (installs nodejs and npm) and configure again")
endif()
file(COPY_FILE ${SRC}/package.json ${DIR}/package.json ONLY_IF_DIFFERENT)
file(COPY_FILE ${SRC}/package-lock.json ${DIR}/package-lock.json ONLY_IF_DIFFERENT)
execute_process(COMMAND ${NPM} ci --ignore-scripts --no-audit --no-fund --loglevel=error
  WORKING_DIRECTORY ${DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pacer report: `npm ci` in ${DIR} failed (${rc}); the report's charting library "
    "(report/package-lock.json) could not be fetched. Check network access to the npm registry or a "
    "populated npm cache, or run `npm ci` in report/ on a connected machine and copy report/node_modules "
    "here; then build again.\n${out}${err}")
endif()
file(TOUCH ${STAMP})
