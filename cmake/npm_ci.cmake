# Installs the report's charting library from report/package-lock.json with
# `npm ci` into a build folder, so the binary embeds exactly the locked version.
# Usage: cmake -DNPM=npm -DSRC=report -DDIR=build/report_node -DSTAMP=file -P npm_ci.cmake
if(NOT NPM)
  message(FATAL_ERROR "pacer report: npm not found; run scripts/deps.sh (installs nodejs and npm) and configure again")
endif()
file(MAKE_DIRECTORY ${DIR})
file(COPY_FILE ${SRC}/package.json ${DIR}/package.json ONLY_IF_DIFFERENT)
file(COPY_FILE ${SRC}/package-lock.json ${DIR}/package-lock.json ONLY_IF_DIFFERENT)
execute_process(COMMAND ${NPM} ci --ignore-scripts --no-audit --no-fund --loglevel=error
  WORKING_DIRECTORY ${DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pacer report: `npm ci` in ${DIR} failed (${rc}); the report's charting library "
    "(report/package-lock.json) could not be fetched. Check network access to the npm registry or a "
    "populated npm cache, then build again.\n${out}${err}")
endif()
file(TOUCH ${STAMP})
